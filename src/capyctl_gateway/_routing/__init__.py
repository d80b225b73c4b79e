"""Where a request goes: placing it on its deployment's queue and instances, and the router's
lines that say why.

``place`` takes a request's running slot (a launched deployment that serves nothing is asked
to start, and its requests wait for it), chooses an instance from the request's routing facts
and the engines' load, and fails over to the next instance when the engine provably never got
the request; one process and the workers' authority place every request through it, each
running every offer inline (``async with place(...) as offers: async for offer in offers``).
``lines`` writes the ``router_selection`` and ``router_failover`` events beside the choice, and
says why an instance was skipped.

Never imports the HTTP surface, the relay, the lifecycle's rooms or management: what a request
is (its ID, its caller's, its deployment, its routing facts) reaches it as a `Placing`.
"""
