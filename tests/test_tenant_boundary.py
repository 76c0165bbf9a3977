"""What the chart adds beside the ranks stays inside the tenant boundary: the config check hook runs where and as the
platform schedules the workers (their queue, PriorityClass and placement), with a fixed small request and a short
deadline, as an account of the release's own; hostile values beside legitimate ones."""

import json

import pytest

from tests.support.chart import HELM, HelmError, container, hooks, render_chart

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


# ---------------------------------------------------------------- the object store's credentials

STORE = {"progress": {"image": "registry.example.com/platform/sidecar:1"},
         "checkpoints": {"objectStore": {"bucket": "ml-checkpoints", "endpoint": "https://s3.example.com",
                                         "credentialsSecret": "ml-checkpoints-s3", "caConfigMap": "private-ca"}}}


def pods(docs):
    return [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("StatefulSet", "Job")
            and "helm.sh/hook" not in d["metadata"].get("annotations", {})]


def names_the_secret(c) -> bool:
    return any((e.get("valueFrom") or {}).get("secretKeyRef", {}).get("name") == "ml-checkpoints-s3"
               for e in c.get("env", []))


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_the_object_stores_credentials_reach_only_the_platforms_containers(mode):
    docs = render_chart({**STORE, "launchMode": mode})
    scripts = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-scripts"))
    assert {"podruntime.objectstore.py", "podruntime.checkpoints.py"} <= set(scripts["data"]), sorted(scripts["data"])
    for pod in pods(docs):
        holders = [c for c in pod.get("initContainers", []) + pod["containers"] if names_the_secret(c)]
        assert [c["name"] for c in holders] == ["restore", "progress"], [c["name"] for c in holders]
        assert {c["image"] for c in holders} == {"registry.example.com/platform/sidecar:1"}
        assert [c["name"] for c in pod["initContainers"]][:2] == ["restore", "progress"]  # restored before ranks
        restore = pod["initContainers"][0]
        mounts = {m["name"]: m for m in restore["volumeMounts"]}
        assert mounts["object-store-ca"]["readOnly"] is True
        assert {v["name"]: v for v in pod["volumes"]}["object-store-ca"]["configMap"]["name"] == "private-ca"
        worker = "checkpoints" in {m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
        if worker:  # the worker's volume: written by the restore, read by the uploads
            assert mounts["checkpoints"]["readOnly"] is False
            upload = {m["name"]: m for m in pod["initContainers"][1]["volumeMounts"]}["checkpoints"]
            assert upload["readOnly"] is True
        else:  # the launcher of launchMode ssh keeps only the ledger, in its /tmp
            assert "checkpoints" not in mounts and "tmp" in mounts


SECRET_PATHS = {
    "env valueFrom": ({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "ml-checkpoints-s3",
                                                                            "key": "AWS_SECRET_ACCESS_KEY"}}}]},
                      "env[0].valueFrom.secretKeyRef"),
    "extraEnv": ({"worker": {"extraEnv": [{"name": "X", "valueFrom": {"secretKeyRef": {
        "name": "ml-checkpoints-s3", "key": "AWS_ACCESS_KEY_ID"}}}]}}, "worker.extraEnv[0].valueFrom.secretKeyRef"),
    "extraEnvFrom": ({"worker": {"extraEnvFrom": [{"prefix": "APP_", "secretRef": {"name": "ml-checkpoints-s3"}}]}},
                     "worker.extraEnvFrom[0].secretRef"),
    "a secret volume": ({"worker": {"extraVolumes": [{"name": "s", "secret": {"secretName": "ml-checkpoints-s3"}}],
                                    "extraVolumeMounts": [{"name": "s", "mountPath": "/s"}]}},
                        "worker.extraVolumes[0].secret"),
    "a projected secret": ({"worker": {"extraVolumes": [{"name": "s", "projected": {"sources": [
        {"configMap": {"name": "c"}}, {"secret": {"name": "ml-checkpoints-s3"}}]}}],
        "extraVolumeMounts": [{"name": "s", "mountPath": "/s"}]}}, "worker.extraVolumes[0].projected.sources[1]"),
    "the SSH keys": ({"ssh": {"existingSecret": "ml-checkpoints-s3"}}, "ssh.existingSecret"),
}


@pytest.mark.parametrize("case", SECRET_PATHS, ids=SECRET_PATHS.keys())
def test_nothing_of_the_tenants_may_name_the_object_stores_secret(case):
    values, where = SECRET_PATHS[case]
    with pytest.raises(HelmError) as err:
        render_chart({**STORE, **values})
    assert f"{where}" in err.value.stderr and "names the object store's Secret \"ml-checkpoints-s3\"" in \
        err.value.stderr, err.value.stderr
    # The same values naming a Secret of the tenant's own are the tenant's to use.
    render_chart({**STORE, **json.loads(json.dumps(values).replace("ml-checkpoints-s3", "team-secret"))})


@pytest.mark.parametrize("values, message", [
    ({"progress": {"image": ""}}, "checkpoints.objectStore needs progress.enabled and progress.image"),
    ({"progress": {"enabled": False, "image": "x:1"}, "launcher": {"scaleDownWorkers": False}},
     "checkpoints.objectStore needs progress.enabled and progress.image"),
    ({"checkpoints": {"objectStore": {"bucket": "b-1", "credentialsSecret": "s"}}}, "checkpoints.objectStore.endpoint"),
    ({"checkpoints": {"objectStore": {"bucket": "b-1", "endpoint": "https://s3"}}},
     "checkpoints.objectStore.credentialsSecret"),
    ({"checkpoints": {"objectStore": {"bucket": "b-1", "endpoint": "s3.example.com", "credentialsSecret": "s"}}},
     "/checkpoints/objectStore/endpoint"),
])
def test_an_object_store_needs_the_platforms_image_an_endpoint_and_a_secret(values, message):
    merged = {**STORE, **values, "checkpoints": {"objectStore": {
        **STORE["checkpoints"]["objectStore"], **values.get("checkpoints", {}).get("objectStore", {})}}}
    if "checkpoints" in values:
        merged["checkpoints"] = values["checkpoints"]
    with pytest.raises(HelmError) as err:
        render_chart(merged)
    assert message in err.value.stderr, err.value.stderr
