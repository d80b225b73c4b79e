"""Lifecycle: the policy of the engines the gateway runs itself (``launch:`` instances), wherever
they run.

``controller`` holds each launched deployment's state, starts it for the requests that wait for
it (one activation per wave), closes it when idle, switches deployments within the memory
budget (kept per pool: `Site.pool`), and stops everything it started when the gateway stops;
``transitions`` drives each instance through its runner's `Driver` face. Where and how an
engine runs is its runner's room (``_local/``, ``_machines/``), reached only through the seam
(``_deployments/runner.py``).

It reads the deployments' routes and settles cut requests when it stops an engine; it never
imports the HTTP surface, the relay, management, or any runner room.
"""
