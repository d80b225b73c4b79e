"""The Responses API (``POST /v1/responses``) over a chat deployment: the request checked and
turned into the engine's chat request (``request.py``, ``items.py``), and the verified chat
stream turned into a Response (``build.py``, ``output.py``, ``usage.py``), written event by
event or whole (``relay.py``). The gateway keeps no responses.

It rides on chat's parts (the exchange, the block reader and verifier, the figures) and never
imports the public listener (which binds it as a surface), the deployments, the lifecycle,
the fleet, the workers, management or any runner room.
"""
