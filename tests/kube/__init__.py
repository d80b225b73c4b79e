"""A fake Kubernetes for the pod runner's tests: an API server for Pods with the real server's
semantics (apiserver.py; store.py for resourceVersions and watches, objects.py for validation
and defaults, selectors.py, logs.py) and a fake scheduler, kubelet and node controller that run
each pod's container as a local process (kubelet.py; scheduler.py, container.py, runtime.py).
Each module's docstring says where it departs from a real cluster."""
