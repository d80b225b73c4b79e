"""Lifecycle: the engines the gateway runs itself (``launch:`` instances).

``process`` starts one engine process with the flags the gateway forces and stops it with its
process group; ``controller`` holds each launched deployment's state, starts it for the requests
that wait for it (one activation per wave), stops it when idle, switches deployments within the
memory budget, and stops everything it started when the gateway stops.

It reads the deployments' routes and settles cut requests when it stops an engine; it never
imports the HTTP surface, the relay or management.
"""
