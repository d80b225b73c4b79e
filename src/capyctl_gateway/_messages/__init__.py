"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over a
chat deployment: the request and its headers checked and turned into the engine's chat request
(``request.py``, ``content.py``, ``tools.py``, ``headers.py``), the verified chat stream turned
into a Message (``build.py``, ``blocks.py``), written event by event or whole (``relay.py``),
a prompt's tokens counted by the engine's own tokenizer (``count.py``), and every refusal in
Anthropic's shape (``errors.py``). The gateway keeps no messages.

It rides on chat's parts (the exchange, the block reader and verifier, the figures) and never
imports the public listener (which binds it as a surface), the deployments, the lifecycle,
the fleet, the workers, management or any runner room.
"""
