"""The HTTP surface: the public listener's routes, the key, request IDs, reading and checking
requests, and the one place that turns an error into an answer.

It reads the process state (``_gateway``) and calls the relay and the deployments; it never
imports management or the CLI, and nothing below it imports it.
"""
