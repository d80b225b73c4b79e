"""Several processes behind one public port: workers relay, one authority decides.

A worker's public handlers place each request through the authority (``desk.py`` over
``wire.py``); the authority (``authority.py``) places it as one process would and settles what
the worker reports. Never imports ``_management``, ``_lifecycle``, ``_machines`` or the CLI.
"""
