"""The scheduler for the memory budget: which deployment is switched out for one that waits,
and when (``policy.py``), from what each switch costs, as measured (``costs.py``). The lifecycle
asks it while an activation waits for room (``_lifecycle/budget.py``) and does the switch
itself; the scheduler decides when. Reads the lifecycle's states; never imports the HTTP
surface, the relay, management or a runner room."""
