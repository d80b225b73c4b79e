"""Several machines: the server's control channel, hosts and their ingress.

It never imports the HTTP surface, the management API, the lifecycle or the gateway's state: the
server's `Machines` is handed routes and settlement, and gives the lifecycle an ``order``
callable; the host's runtime (``_host.py``) is where a host's engines meet its session.
"""
