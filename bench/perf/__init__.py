"""A side-by-side benchmark of the gateway's hot path: direct, through the gateway, through a peer.

Run ``.venv/bin/python -m bench.perf.run`` from the repository root (see docs/performance.md).
"""
