"""The relay: one exchange with an engine and what travels through it (the hot path).

``exchange`` (the POST and the deadline) with ``ending`` (the error mapping, the connection's
fate), ``chat`` (relay a stream or collect it), ``decisions``, ``sse`` (decoding), ``verify``
(every chunk checked), ``assemble`` (a non-streamed answer), ``figures`` (per-request metrics)
and ``deadline`` (a cheap movable timer).

It knows one engine instance at a time, through what it is handed: it never imports the HTTP
surface (``_http``), the deployments (``_deployments``), management or the process state
(``_gateway``).
"""
