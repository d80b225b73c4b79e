"""Management: the deployment status document, its HTTP API on the loopback management
listener, and its text rendering for ``capyctl-gateway status``.

Reads the process state; the inference path never imports it.
"""
