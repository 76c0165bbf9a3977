"""What the chart adds beside the ranks stays inside the tenant boundary: the config check hook runs where and as the
platform schedules the workers (their queue, PriorityClass and placement), with a fixed small request and a short
deadline, as an account of the release's own; hostile values beside legitimate ones."""

import pytest

from tests.support.chart import HELM, container, hooks, render_chart

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")

PLATFORM = {"global": {"priorityClassName": "training", "nodeSelector": {"pool": "gpu"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            "worker": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}},
            "scheduling": {"kueueQueueName": "team-a"}, "image": {"pullSecrets": ["registry"]}}
PLACEMENT = ("imagePullSecrets", "schedulerName", "priorityClassName", "nodeSelector", "tolerations", "affinity")


def hook_job(docs):
    return next(d for d in hooks(docs) if d["kind"] == "Job")


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_the_config_check_runs_in_the_workers_queue_and_placement_with_a_fixed_small_request(mode):
    docs = render_chart({**PLATFORM, "launchMode": mode})
    job = hook_job(docs)
    workers = next(d for d in docs if d["kind"] in ("StatefulSet", "Job") and "helm.sh/hook" not in
                   d["metadata"].get("annotations", {}) and d["spec"]["template"]["metadata"]["labels"][
                       "app.kubernetes.io/component"] == "worker")["spec"]["template"]
    pod = job["spec"]["template"]
    for labels in (job["metadata"]["labels"], pod["metadata"]["labels"]):
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"  # admitted and counted like the workers
    for field in PLACEMENT:
        assert pod["spec"].get(field) == workers["spec"].get(field), field
    assert pod["spec"]["priorityClassName"] == "training" and pod["spec"]["affinity"] == PLATFORM["worker"]["affinity"]
    assert container(job)["resources"] == {"requests": {"cpu": "250m", "memory": "512Mi"},
                                           "limits": {"cpu": "1", "memory": "1Gi"}}
    assert job["spec"]["activeDeadlineSeconds"] == 300 and job["spec"]["backoffLimit"] == 0
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_config_check_runs_as_an_account_of_the_release_made_before_it():
    """A pre-install hook runs before the release's own ServiceAccount exists: the check's own account is a hook
    that comes first (lower weight), holds no token and has no Role; with a shared account, the platform's."""
    docs = render_chart()
    account = next(d for d in hooks(docs) if d["kind"] == "ServiceAccount")
    assert account["metadata"]["name"] == "job-deepspeed-training-config-check"
    assert account["automountServiceAccountToken"] is False
    weights = {d["kind"]: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in hooks(docs)}
    assert weights["ServiceAccount"] < weights["ConfigMap"] < weights["Job"]
    assert {d["metadata"]["annotations"]["helm.sh/hook"] for d in hooks(docs)} == {"pre-install,pre-upgrade"}
    assert hook_job(docs)["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert all(s["name"] != account["metadata"]["name"] for d in docs if d["kind"] == "RoleBinding"
               for s in d["subjects"])
    shared = render_chart({"serviceAccount": {"create": False, "name": "platform-trainer"},
                           "launcher": {"scaleDownWorkers": False}})
    assert [d["kind"] for d in hooks(shared)] == ["ConfigMap", "Job"]
    assert hook_job(shared)["spec"]["template"]["spec"]["serviceAccountName"] == "platform-trainer"


def test_the_config_check_joins_no_gang_and_may_have_a_queue_of_its_own():
    api = ["scheduling.k8s.io/v1alpha2/Workload"]
    gang = hook_job(render_chart({"scheduling": {"gangScheduling": True}}, api_versions=api))["spec"]["template"]
    assert "schedulingGroup" not in gang["spec"] and "workloadRef" not in gang["spec"]
    volcano = hook_job(render_chart({"scheduling": {"volcano": {"enabled": True}}}))["spec"]["template"]
    assert volcano["spec"]["schedulerName"] == "volcano"  # Volcano's scheduler, in a group of its own
    assert "scheduling.k8s.io/group-name" not in volcano["metadata"].get("annotations", {})
    own = hook_job(render_chart({**PLATFORM, "configCheck": {"kueueQueueName": "checks"}}))
    assert own["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "checks"
    assert "kueue.x-k8s.io/queue-name" not in hook_job(render_chart())["metadata"]["labels"]
