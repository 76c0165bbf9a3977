"""What each pod of a release asks of a node, added up as the scheduler does, and whether the job fits a cluster's
nodes: on empty nodes, and now (beside what already runs there). `make plan` prints both; without a reachable
cluster, or without the right to list nodes (cluster-scoped), it says so in one line."""

from dataclasses import dataclass, field
from decimal import Decimal

from kubernetes.utils import parse_quantity

from scripts.deployctl.common import manifest_docs

REQUEST_TIMEOUT_S = 5
KINDS = ("StatefulSet", "Job", "Deployment")


def _requests(container: dict) -> dict[str, Decimal]:
    resources = container.get("resources") or {}
    # A limit without a request is the request too (the API server defaults it so).
    asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: parse_quantity(value) for name, value in asked.items()}


def _add(a: dict, b: dict) -> dict:
    return {k: a.get(k, Decimal(0)) + b.get(k, Decimal(0)) for k in {*a, *b}}


def _max(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, Decimal(0)), b.get(k, Decimal(0))) for k in {*a, *b}}


def pod_requests(spec: dict) -> dict[str, Decimal]:
    """A pod's requests as the scheduler counts them (Kubernetes' PodRequests): the containers add up, and so do
    sidecars (init containers with restartPolicy Always); an init container that runs to completion needs its own
    request beside the sidecars started before it, and the pod reserves the larger of the two; then its overhead."""
    total: dict = {}
    for container in spec.get("containers") or []:
        total = _add(total, _requests(container))
    sidecars: dict = {}
    init: dict = {}
    for container in spec.get("initContainers") or []:
        asked = _requests(container)
        if container.get("restartPolicy") == "Always":
            total = _add(total, asked)
            sidecars = _add(sidecars, asked)
            init = _max(init, sidecars)
        else:
            init = _max(init, _add(asked, sidecars))
    total = _max(total, init)
    return _add(total, {k: parse_quantity(v) for k, v in (spec.get("overhead") or {}).items()})


@dataclass
class PodGroup:
    component: str
    count: int
    requests: dict[str, Decimal]
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)


def pod_groups(manifests: str) -> list[PodGroup]:
    """The job's running pods by component (workers, launcher): how many, each one's requests. Hooks (the config
    check) run before them and alone."""
    groups = []
    for doc in manifest_docs(manifests):
        if not (isinstance(doc, dict) and doc.get("kind") in KINDS):
            continue
        if "helm.sh/hook" in ((doc.get("metadata") or {}).get("annotations") or {}):
            continue
        spec = doc["spec"]
        count = spec.get("replicas", 1) if doc["kind"] != "Job" else spec.get("parallelism", 1)
        template = spec["template"]
        component = (template.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/component", doc["kind"])
        pod = template["spec"]
        groups.append(PodGroup(component, int(count), pod_requests(pod), pod.get("nodeSelector") or {},
                               pod.get("tolerations") or []))
    return groups


def show(requests: dict[str, Decimal]) -> str:
    def one(name: str, value: Decimal) -> str:
        if name == "cpu":
            return f"{value.normalize():f} CPU" if value >= 1 else f"{int(value * 1000)}m CPU"
        if name in ("memory", "ephemeral-storage") or name.startswith("hugepages-"):
            gib = value / 1024 ** 3
            return f"{gib:.1f} GiB {name}" if gib >= 1 else f"{int(value / 1024 ** 2)} MiB {name}"
        return f"{value.normalize():f} {name}"
    order = sorted(requests, key=lambda n: (n != "cpu", n != "memory", n))
    return ", ".join(one(n, requests[n]) for n in order if requests[n]) or "nothing"


def requests_line(groups: list[PodGroup]) -> str:
    total: dict = {}
    for group in groups:
        for _ in range(group.count):
            total = _add(total, group.requests)
    parts = [f"{group.count} {group.component} pod{'s' if group.count != 1 else ''} x {show(group.requests)}"
             for group in groups]
    return (f"  requests    {'; '.join(parts)} (each pod's containers and sidecars added, its init containers' "
            f"largest beside them); the job {show(total)}")


# ---- the cluster's nodes


@dataclass
class Node:
    name: str
    free: dict[str, Decimal]  # allocatable, less what runs there when judging "now"
    labels: dict[str, str]
    taints: list[dict]


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations:
        if t.get("effect") not in (None, "", taint.get("effect")):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


ONE_POD = {"pods": Decimal(1)}  # a node's allocatable `pods`: every pod takes one


def _can_host(node: Node, group: PodGroup, asked: dict[str, Decimal]) -> bool:
    if any(node.labels.get(k) != v for k, v in group.node_selector.items()):
        return False
    blocking = [t for t in node.taints if t.get("effect") in ("NoSchedule", "NoExecute")]
    if not all(_tolerates(group.tolerations, t) for t in blocking):
        return False
    return all(node.free.get(k, Decimal(0)) >= v for k, v in asked.items() if v and (k != "pods" or k in node.free))


def fits(groups: list[PodGroup], nodes: list[Node]) -> str | None:
    """None when every pod of the job finds a node at once by first fit, largest pods first, else why not (a
    first-fit "no" can miss a packing that exists: said in the plan's line)."""
    free = [Node(n.name, dict(n.free), n.labels, n.taints) for n in nodes]
    pods = sorted(((g, i) for g in groups for i in range(g.count)), key=lambda p: -sum(p[0].requests.values()))
    for placed, (group, index) in enumerate(pods):
        asked = _add(group.requests, ONE_POD)
        host = next((n for n in free if _can_host(n, group, asked)), None)
        if host is None:
            return (f"{group.component} pod {index + 1} of {group.count} ({show(group.requests)}) finds no node "
                    f"after {placed} other pod{'s' if placed != 1 else ''}")
        host.free = {k: v - asked.get(k, Decimal(0)) for k, v in host.free.items()}
    return None


def nodes_of(core, running: bool) -> list[Node]:
    """The cluster's schedulable nodes, with their allocatable resources, less (running=True) the requests of
    every pod that runs on them."""
    nodes = []
    for item in core.list_node(_request_timeout=REQUEST_TIMEOUT_S).items:
        if item.spec.unschedulable:
            continue
        allocatable = {k: parse_quantity(v) for k, v in (item.status.allocatable or {}).items()}
        taints = [{"key": t.key, "value": t.value or "", "effect": t.effect} for t in item.spec.taints or []]
        nodes.append(Node(item.metadata.name, allocatable, item.metadata.labels or {}, taints))
    if running:
        by_name = {n.name: n for n in nodes}
        pods = core.list_pod_for_all_namespaces(field_selector="status.phase!=Succeeded,status.phase!=Failed",
                                                _request_timeout=REQUEST_TIMEOUT_S).items
        for pod in pods:
            node = by_name.get(pod.spec.node_name or "")
            if node is not None:
                spec = core.api_client.sanitize_for_serialization(pod.spec)
                used = _add(pod_requests(spec), ONE_POD)
                node.free = {k: v - used.get(k, Decimal(0)) for k, v in node.free.items()}
    return nodes


def fit_lines(groups: list[PodGroup], context: str | None) -> list[str]:
    """`make plan`'s two lines against the cluster of `context`, or one line saying why it was not asked."""
    try:
        from kubernetes import client, config

        api = config.new_client_from_config(context=context)
        core = client.CoreV1Api(api)
        empty = nodes_of(core, running=False)
    except Exception as err:  # noqa: BLE001 - no kube config, no cluster, no right: one line, never a stop
        return [f"  fits        not checked: {_why_not(err)}"]
    if not empty:
        return ["  fits        on empty nodes: no: the cluster has no schedulable node"]
    lines = [f"  fits        on empty nodes: {_verdict(fits(groups, empty))} ({len(empty)} schedulable "
             f"node{'s' if len(empty) != 1 else ''}, first fit, largest pods first; node affinity and topology not "
             "judged)"]
    try:
        lines.append(f"  fits        now: {_verdict(fits(groups, nodes_of(core, running=True)))}")
    except Exception as err:  # noqa: BLE001
        lines.append(f"  fits        now: not checked: {_why_not(err)}")
    return lines


def _verdict(why_not: str | None) -> str:
    return "yes" if why_not is None else f"no: {why_not}"


def _why_not(err: Exception) -> str:
    status = getattr(err, "status", None)
    if status in (401, 403):
        return f"the cluster refused the request (HTTP {status}: listing nodes and pods is cluster-scoped)"
    text = " ".join(str(err).split())
    return f"no cluster reached ({type(err).__name__}: {text[:160]})"
