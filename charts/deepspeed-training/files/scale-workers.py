"""Scales the worker StatefulSet to 0 after a successful run (launcher.scaleDownWorkers).

Uses the pod's ServiceAccount token; its Role may patch only this StatefulSet's scale subresource.
Outside a cluster (tests) it uses $KUBECONFIG. Env: DS_WORKER_STATEFULSET (name), POD_NAMESPACE.
"""

import os
import sys

from kubernetes import client, config


def main() -> int:
    name, namespace = os.environ["DS_WORKER_STATEFULSET"], os.environ["POD_NAMESPACE"]
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    client.AppsV1Api().patch_namespaced_stateful_set_scale(name, namespace, {"spec": {"replicas": 0}})
    print(f"launcher: scaled statefulset {namespace}/{name} to 0 replicas", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
