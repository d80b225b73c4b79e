"""Switching under contention (issue 44): the gateway's switching policies side by side, in
one run, on the scenarios where more models than memory are served at once.

Policies (``resources.switching``): ``on_arrival`` (the gateway before its scheduler: a switch
as soon as a request arrives and a deployment may go), ``collate`` (llama-swap's collation:
each model's waiting requests served together, a switch as soon as the resident model has
nothing to do, nothing kept resident) and ``cost_aware`` (the scheduler,
``src/capyctl_gateway/_scheduling/policy.py``), each with the defaults (``max_switch_wait`` 30 s,
``switch_patience`` 2).

Scenarios (``scenarios.py``): (i) two closed-loop agents on two models, a budget for one;
(ii) three models, a budget for two, skewed load; (iii) a steady stream for one model and a
trickle for another. Engines (``engines.py``): the launchable fake engine at vLLM's published
sleep-mode costs, and real llama-servers at their own.

Every run gets a fresh gateway (a ``capyctl-gateway serve`` process, which launches and
switches the engines itself), brings each deployment in once, then sends the scenario's load
for its window. Figures: requests answered per minute (over the window and the time its last
answers took), engine starts and wakes per answered request, p50/p95/max wait per deployment
(the time to a streamed answer's first chunk), the share of the time spent starting, waking,
parking, stopping or draining (``capyctl_lifecycle_seconds_total``), the switches by reason
(``capyctl_switches_total``), what the deployments list showed waiting, and every request not
answered whole (lost). See ``docs/performance.md``.

Run: ``.venv/bin/python -m bench.contention [--quick] [--engines fake,llamacpp] [--out FILE]``.
"""
