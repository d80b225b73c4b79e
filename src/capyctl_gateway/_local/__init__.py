"""An engine on this machine: a runner room.

``runner`` is the `LocalRunner` (the seam's every member for an engine on this machine);
``process`` runs one engine process under its keeper (``reaper``, run as its own small
process), with its bounded, masked log (``enginelog``); ``parking`` and ``wakecheck`` park,
wake and check an engine through its own routes; ``seen`` is what the collector says of it;
``pids`` records its process so that a restarted gateway outlasts a previous run's engines.

Only the registry of runner kinds (``_runners.py``) imports it; it never imports the policy
(``_lifecycle/``), another runner room, the HTTP surface, the relay or management.
"""
