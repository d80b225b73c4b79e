"""Deployments: the routes built from the configuration (instances, instance choice), the
waiting queue, and the settlement of cut requests against the collector's samples.

Pure bookkeeping over asyncio: it never imports the HTTP surface (``_http``), the relay
(``_relay``), management or the process state (``_gateway``), and does no I/O of its own.
"""
