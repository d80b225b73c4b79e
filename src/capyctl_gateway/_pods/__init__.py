"""The room of engines run as Kubernetes pods: the cluster's client (``kube.py``), one watch per
namespace (``watch.py``), the Pod the gateway creates (``manifest.py``) and reads
(``podstate.py``), the cluster's opening and a previous run's pods (``cluster.py``), and the
runner (``runner.py``). Drives its engines through the seam (``_deployments/runner.py``); never
the lifecycle's policy."""
