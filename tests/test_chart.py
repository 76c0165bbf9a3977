"""The chart, rendered by the real helm 4 and helm 3 binaries."""

import base64
import json
import subprocess

import pytest
import yaml

from podruntime.sidecar import sample_bound
from tests.support.chart import (
    CHART,
    CI_VALUES,
    HELM,
    HelmError,
    by_kind,
    container,
    env_of,
    helm_binaries,
    one,
    release_workloads,
    render_chart,
)

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")
HELMS = helm_binaries()
WORKER, LAUNCHER = "worker", "launcher"


def workloads(docs):
    return one(docs, "StatefulSet", "-worker"), one(docs, "Job", "-launcher-1")


def config_data(docs) -> dict:
    return one(docs, "ConfigMap", "-config")["data"]


@pytest.mark.parametrize("helm", HELMS.values(), ids=HELMS.keys())
@pytest.mark.parametrize("values_file", CI_VALUES, ids=[f.name for f in CI_VALUES])
def test_ci_values_render_the_job(helm, values_file):
    docs = render_chart(values_files=[values_file], helm=helm)
    kinds = {d["kind"] for d in docs}
    values = yaml.safe_load(values_file.read_text())
    ssh = values.get("launchMode", "ssh") == "ssh"  # nossh: the workers are the Job; no sshd, Secret or Role
    assert {"Service", "Job", "ConfigMap"} <= kinds and ("StatefulSet" in kinds) == ssh
    assert ("Secret" in kinds) == (ssh and "existingSecret" not in values.get("ssh", {}))
    assert ("NetworkPolicy" in kinds) == values.get("networkPolicy", {}).get("enabled", True)
    # Roles (the progress sidecars': the ConfigMap, and in ssh mode the workers' scale) only with the release's own
    # account: never bound to `default` or a shared one.
    own_account = values.get("serviceAccount", {}).get("create", True)
    assert ("Role" in kinds) == (own_account and values.get("progress", {}).get("enabled", True))


@pytest.mark.parametrize("values_file", CI_VALUES, ids=[f.name for f in CI_VALUES])
def test_helm_lint_strict_is_clean(values_file):
    for helm in HELMS.values():
        proc = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(values_file)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_selectors_hold_only_name_instance_component():
    docs = render_chart()
    sts, job = workloads(docs)
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "deepspeed-training", "app.kubernetes.io/instance": "job",
                        "app.kubernetes.io/component": WORKER}
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert pod_labels["helm.sh/chart"].startswith("deepspeed-training-")
    service = one(docs, "Service")
    assert service["spec"]["selector"] == selector
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == LAUNCHER
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", doc["kind"]


def test_headless_service_publishes_workers_before_ready():
    docs = render_chart()
    service, (sts, _) = one(docs, "Service"), workloads(docs)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "ssh", "port": 2222, "targetPort": "ssh", "protocol": "TCP"}]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_gpus_per_worker_sets_slots_and_limits():
    docs = render_chart({"worker": {"replicas": 3, "gpusPerWorker": 4, "resources": {"limits": {"memory": "8Gi"}}}})
    hostfile = config_data(docs)["hostfile"].splitlines()
    domain = "job-deepspeed-training-worker.default.svc.cluster.local"
    assert hostfile == [f"job-deepspeed-training-worker-{i}.{domain} slots=4" for i in range(3)]
    sts, _ = workloads(docs)
    assert sts["spec"]["replicas"] == 3
    assert container(sts)["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": 4}


def test_empty_gpu_resource_name_requests_no_gpu():
    sts, _ = workloads(render_chart({"worker": {"gpuResourceName": "", "gpusPerWorker": 2}}))
    assert container(sts)["resources"] == {}


def test_resources_take_standard_hugepages_and_extended_names():
    requests = {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "10Gi"}
    docs = render_chart({"worker": {"resources": {"requests": requests,
                                                  "limits": {"hugepages-2Mi": "1Gi", "example.com/fpga": 1}}},
                         "launcher": {"resources": {"limits": {"hugepages-1Gi": "2Gi", "rdma/hca_devices": 1}}},
                         "progress": {"resources": {"requests": {"cpu": "20m", "memory": "64Mi"}}}})
    worker = container(one(docs, "StatefulSet"))
    assert worker["resources"]["limits"] == {"hugepages-2Mi": "1Gi", "example.com/fpga": 1, "nvidia.com/gpu": 1}


def test_projected_volumes_of_plain_data_need_no_opt_in():
    sources = [{"configMap": {"name": "c"}}, {"secret": {"name": "s"}}, {"clusterTrustBundle": {
        "signerName": "example.com/ca", "path": "ca.pem"}}, {"downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]
    docs = render_chart({"worker": {"extraVolumes": [{"name": "bundle", "projected": {"sources": sources}}]}})
    pod = one(docs, "StatefulSet")["spec"]["template"]
    assert "deepspeed-training/security-relaxations" not in pod["metadata"]["annotations"]
    assert next(v for v in pod["spec"]["volumes"] if v["name"] == "bundle")["projected"]["sources"] == sources


def test_gpu_resource_name_is_configurable():
    sts, _ = workloads(render_chart({"worker": {"gpuResourceName": "amd.com/gpu", "gpusPerWorker": 8}}))
    assert container(sts)["resources"]["limits"] == {"amd.com/gpu": 8}


def test_ds_config_in_configmap_equals_values():
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": True}}
    docs = render_chart({"deepspeed": {"config": config}, "worker": {"replicas": 4, "gpusPerWorker": 2},
                         "checkpoints": {"existingClaim": "shared"}})
    rendered = json.loads(config_data(docs)["ds_config.json"])
    assert rendered == config  # replaces the default whole: no default key is merged in


def test_empty_ds_config_uses_the_default_file():
    rendered = json.loads(config_data(render_chart({"checkpoints": {"existingClaim": "c"}}))["ds_config.json"])
    assert rendered == json.loads((CHART / "files" / "ds_config.default.json").read_text())


def test_train_config_and_args_reach_the_launcher_command():
    docs = render_chart({"train": {"config": {"steps": 7}, "args": ["--log-every", "3"], "module": "mytrain"}})
    assert json.loads(config_data(docs)["train_config.json"]) == {"steps": 7}
    _, job = workloads(docs)
    args = container(job)["args"]
    assert container(job)["command"] == ["python3", "-I", "/etc/deepspeed/scripts", "launcher"]
    assert args[0] == "deepspeed"
    # DeepSpeed's launcher runs each rank through the chart's rank-log.py (its lines carry its rank and attempt).
    assert args[args.index("-m") - 1:args.index("-m") + 2] == ["/etc/deepspeed/scripts/rank-log.py", "-m", "mytrain"]
    assert "--module" not in args
    assert "--ds-config=/etc/deepspeed/config/ds_config.json" in args
    assert "--config=/etc/deepspeed/config/train_config.json" in args
    assert "--checkpoint-dir=/checkpoints" in args
    assert "--force_multi" in args  # ranks never run in the launcher pod, also with one worker
    # The program's own arguments, then the chart's (argparse keeps the last occurrence: the chart's win)
    assert args[args.index("mytrain") + 1:] == ["--log-every", "3", "--ds-config=/etc/deepspeed/config/ds_config.json",
                                                "--config=/etc/deepspeed/config/train_config.json",
                                                "--checkpoint-dir=/checkpoints"]
    worker0 = "job-deepspeed-training-worker-0.job-deepspeed-training-worker.default.svc.cluster.local"
    assert f"--master_addr={worker0}" in args


def test_ssh_keys_live_only_in_the_secret_and_load_in_openssh(tmp_path):
    docs = render_chart()
    secret = one(docs, "Secret")
    assert set(secret["data"]) == {"id_ecdsa", "ssh_host_ecdsa_key"}
    for name, encoded in secret["data"].items():
        key = tmp_path / name
        key.write_bytes(base64.b64decode(encoded))
        key.chmod(0o600)
        public = subprocess.run(["ssh-keygen", "-y", "-f", str(key)], capture_output=True, text=True, check=True)
        assert public.stdout.startswith("ecdsa-sha2-nistp256 ")
    for doc in docs:
        if doc["kind"] != "Secret":
            assert "PRIVATE KEY" not in yaml.safe_dump(doc), doc["kind"]


def test_existing_secret_replaces_the_generated_one():
    docs = render_chart({"ssh": {"existingSecret": "team-keys"}})
    assert by_kind(docs, "Secret") == []
    for workload in workloads(docs):
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["ssh-keys"]["secret"]["secretName"] == "team-keys"


def test_pods_run_restricted_and_workers_get_an_sshd_readiness_probe():
    sts, job = workloads(render_chart())
    for workload in (sts, job):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        ctx = container(workload)["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["readOnlyRootFilesystem"] is True
    # The probes read the socket table (files/sshd-listening.sh): a TCP probe makes sshd log every 5 s.
    probe = ["bash", "/etc/deepspeed/scripts/sshd-listening.sh"]
    assert container(sts)["readinessProbe"]["exec"]["command"] == probe
    assert container(sts)["livenessProbe"]["exec"]["command"] == probe
    assert container(sts)["ports"][0] == {"name": "ssh", "containerPort": 2222, "protocol": "TCP"}


def test_no_container_of_the_tenants_image_holds_a_token_and_the_launchers_sidecar_scales_the_workers():
    docs = render_chart()
    sts, job = workloads(docs)
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    for pod in (sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        assert pod["automountServiceAccountToken"] is False
        assert token_mounts(pod) == {"progress": ["progress-token"], pod["containers"][0]["name"]: []}
    role = one(docs, "Role", "-scale-workers")
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                              "resourceNames": [sts["metadata"]["name"]], "verbs": ["patch"]}]
    assert one(docs, "RoleBinding", "-scale-workers")["subjects"] == [
        {"kind": "ServiceAccount", "name": one(docs, "ServiceAccount")["metadata"]["name"], "namespace": "default"}]
    sidecar = job["spec"]["template"]["spec"]["initContainers"][0]
    command = sidecar["command"]
    assert command[command.index("--scale-down") + 1] == sts["metadata"]["name"]
    assert "--scale-down" not in sts["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert not {"DS_SCALE_DOWN_WORKERS", "DS_WORKER_STATEFULSET"} & set(env_of(job))


def test_keeping_workers_up_drops_the_scale_role_and_the_sidecars_scale_down():
    docs = render_chart({"launcher": {"scaleDownWorkers": False}})
    _, job = workloads(docs)
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role") + by_kind(docs, "RoleBinding")] == \
        ["job-deepspeed-training-progress"] * 2  # the progress sidecars' only
    assert "--scale-down" not in job["spec"]["template"]["spec"]["initContainers"][0]["command"]


def token_mounts(pod_spec: dict) -> dict[str, list[str]]:
    """Container name -> the volumes it mounts at the service-account token path."""
    return {c["name"]: [m["name"] for m in c.get("volumeMounts", [])
                        if m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"]
            for c in pod_spec.get("initContainers", []) + pod_spec["containers"]}


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_the_progress_role_patches_one_configmap_and_only_the_sidecar_holds_its_token(mode):
    docs = render_chart({"launchMode": mode, "launcher": {"scaleDownWorkers": False}})
    role = one(docs, "Role", "-progress")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "resourceNames": ["job-deepspeed-training-progress"], "verbs": ["get", "patch"]}]
    binding = one(docs, "RoleBinding", "-progress")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "job-deepspeed-training", "namespace": "default"}]
    assert "data" not in one(docs, "ConfigMap", "-progress")  # the sidecars' own: Helm never claims it
    pods = [d["spec"]["template"]["spec"] for d in release_workloads(docs)]
    assert len(pods) == (2 if mode == "ssh" else 1)
    for pod in pods:
        assert pod["automountServiceAccountToken"] is False
        main = "worker" if pod["containers"][0]["name"] == "worker" else "launcher"
        assert token_mounts(pod) == {"progress": ["progress-token"], main: []}
        sidecar = pod["initContainers"][0]
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar: the Job's pod ends with its main container
        assert sidecar["command"][:4] == ["python3", "-I", "/etc/deepspeed/scripts", "sidecar"]
        # Node rank 0's sidecar holds rank 0's progress; the ledger's owner's (ssh: launcher; nossh: worker 0) the
        # job's record. DS_NODE_RANK says which worker a pod is.
        role = (["--progress", "--job"] if mode == "nossh" else ["--progress"]) if main == "worker" else ["--job"]
        sizes = ["--world-size", "2", "--ranks-per-pod", "1"] if main == "worker" else []
        assert sidecar["command"][4:] == ["--configmap", "job-deepspeed-training-progress", *role, *sizes,
                                          "--metrics-port", "9400"]
        node_rank = {e["name"]: e for e in sidecar["env"]}.get("DS_NODE_RANK")
        label = "batch.kubernetes.io/job-completion-index" if mode == "nossh" else "apps.kubernetes.io/pod-index"
        assert (node_rank and node_rank["valueFrom"]["fieldRef"]["fieldPath"]) == (
            f"metadata.labels['{label}']" if main == "worker" else None)
        assert sidecar["image"] == pod["containers"][0]["image"]  # progress.image empty: the workers' image
        assert sidecar["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
        assert sidecar["securityContext"] == pod["containers"][0]["securityContext"]
        assert {"name": "tmp", "mountPath": "/tmp"} in sidecar["volumeMounts"]  # it writes the job's identity there
        # the main container starts once it has (a native sidecar's startupProbe)
        assert sidecar["startupProbe"]["exec"]["command"] == ["test", "-f", "/tmp/deepspeed-ranks/job.id"]
        token = next(v for v in pod["volumes"] if v["name"] == "progress-token")["projected"]["sources"]
        assert token[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}}


@pytest.mark.parametrize("account", [{"create": False}, {"create": False, "name": "shared-trainer"}])
def test_progress_is_bound_only_to_the_releases_own_account_and_can_be_switched_off(account):
    # A shared account (`default`, or one other releases run as) would let them patch this release's progress.
    docs = render_chart({"serviceAccount": account, "launcher": {"scaleDownWorkers": False}})
    assert by_kind(docs, "Role") == [] and by_kind(docs, "RoleBinding") == []
    for pod in (w["spec"]["template"]["spec"] for w in workloads(docs)):
        assert "--configmap" not in pod["initContainers"][0]["command"]  # metrics only
        assert all(m == [] for m in token_mounts(pod).values())
    docs = render_chart({"progress": {"enabled": False}, "launcher": {"scaleDownWorkers": False}})
    assert [d for d in docs if d["metadata"]["name"].endswith("-progress")] == []
    assert all("initContainers" not in w["spec"]["template"]["spec"] for w in workloads(docs))


def test_the_pod_monitor_needs_the_value_and_the_api_and_the_metrics_port_opens_only_to_named_peers():
    api = "monitoring.coreos.com/v1/PodMonitor"
    assert by_kind(render_chart({"progress": {"podMonitor": True}}), "PodMonitor") == []
    assert by_kind(render_chart(api_versions=[api]), "PodMonitor") == []
    monitor = one(render_chart({"progress": {"podMonitor": True}}, api_versions=[api]), "PodMonitor")
    # The release from the pod's own labels, never from the exposition; a flood fails the scrape (tests/test_sidecar)
    assert monitor["spec"]["podMetricsEndpoints"] == [{
        "port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": False, "relabelings": [
            {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"], "targetLabel": "release",
             "action": "replace"}]}]
    assert monitor["spec"]["sampleLimit"] == sample_bound()["fixed"] + sample_bound()["perRank"]  # 1 GPU a worker
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "job"
    release = {"app.kubernetes.io/name": "deepspeed-training", "app.kubernetes.io/instance": "job"}
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    policy = one(render_chart({"progress": {"metricsFrom": scrapers}}), "NetworkPolicy")
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]},
                                         {"from": scrapers, "ports": [{"port": "metrics", "protocol": "TCP"}]}]


@pytest.mark.parametrize("peer", [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {}, {"podSelector": {}},
                                  {"namespaceSelector": {"matchExpressions": []}},
                                  {"namespaceSelector": {"matchLabels": {}}}, {"podSelector": {"matchLabels": {}}}])
def test_metrics_scrapers_are_label_selectors_only(peer):
    with pytest.raises(HelmError) as err:
        render_chart({"progress": {"metricsFrom": [peer]}})
    assert "progress/metricsFrom/0" in err.value.stderr


def test_network_policy_admits_only_pods_of_the_release():
    docs = render_chart()
    policy = one(docs, "NetworkPolicy")
    release = {"app.kubernetes.io/name": "deepspeed-training", "app.kubernetes.io/instance": "job"}
    assert policy["spec"]["podSelector"]["matchLabels"] == release
    for workload in workloads(docs):
        assert release.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    assert by_kind(render_chart({"networkPolicy": {"enabled": False}, "allowSecurityRelaxations": True}),
                   "NetworkPolicy") == []


def test_checksum_rolls_pods_when_ds_config_changes():
    def checksums(values):
        return [w["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for w in workloads(render_chart(values))]
    base = checksums(None)
    assert base[0] == base[1]
    assert checksums(None) == base  # stable: generated keys are not part of it
    assert checksums({"deepspeed": {"config": {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5}}}) != base


def test_plain_env_goes_to_deepspeed_env_and_secret_env_through_the_worker():
    env = [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "PATHS", "value": "/a:/b,c=d"},
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    docs = render_chart({"env": env})
    assert config_data(docs)["deepspeed_env"] == "NCCL_DEBUG=INFO\nPATHS=/a:/b,c=d\n"
    sts, job = workloads(docs)
    worker_env = env_of(sts)
    assert worker_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert "HF_TOKEN" not in env_of(job)
    assert "hf" not in config_data(docs)["deepspeed_env"]


@pytest.mark.parametrize("value", ["a$(id)", "`id`", 'say "hi"', "back\\slash", "two\nlines", "${HOME}"])
def test_hostile_env_values_are_refused_naming_the_key(value):
    with pytest.raises(HelmError) as err:
        render_chart({"env": [{"name": "OK", "value": "fine"}, {"name": "EVIL", "value": value}]})
    assert "env[1] (EVIL)" in err.value.stderr
    assert "valueFrom" in err.value.stderr


@pytest.mark.parametrize("arg", ["$(id)", "a b", "x;rm", "--name='q'"])
def test_train_args_that_a_remote_shell_would_interpret_are_refused(arg):
    with pytest.raises(HelmError) as err:
        render_chart({"train": {"args": ["--ok", arg]}})
    assert "train.args[1]" in err.value.stderr


def test_checkpoint_volume_follows_the_values():
    def checkpoint_volume(values):
        sts, _ = workloads(render_chart({"checkpoints": values}))
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        return volumes.get("checkpoints"), sts["spec"].get("volumeClaimTemplates")

    volume, claims = checkpoint_volume({"existingClaim": "ckpt"})
    assert volume["persistentVolumeClaim"] == {"claimName": "ckpt"} and claims is None
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}
    sts, _ = workloads(render_chart({"worker": {"replicas": 1}, "checkpoints": {"volumeClaimSpec": spec}}))
    volume = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}.get("checkpoints")
    claims = sts["spec"].get("volumeClaimTemplates")
    assert volume is None and claims[0]["metadata"]["name"] == "checkpoints" and claims[0]["spec"] == spec
    volume, claims = checkpoint_volume({"mountPath": "/ckpt"})
    assert volume == {"name": "checkpoints", "emptyDir": {}} and claims is None


def test_data_claim_is_mounted_read_only_on_workers_only():
    sts, job = workloads(render_chart({"data": {"existingClaim": "corpus", "mountPath": "/corpus"}}))
    mounts = {m["name"]: m for m in container(sts)["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/corpus", "readOnly": True}
    assert "data" not in {m["name"] for m in container(job)["volumeMounts"]}  # no Multi-Attach with RWO


def test_the_launcher_job_is_per_revision_and_retries_safely():
    _, job = workloads(render_chart())
    assert job["spec"]["podReplacementPolicy"] == "Failed"
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        # The main container's exit codes only: the progress sidecar's never decide.
        {"action": "FailJob", "onExitCodes": {"containerName": "launcher", "operator": "In", "values": [2, 3]}},
        {"action": "Ignore", "onExitCodes": {"containerName": "launcher", "operator": "In", "values": [143]}}]
    assert job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 150  # worker grace + 30
    assert env_of(job)["DS_KILL_GRACE_SECONDS"] == "110"


CLAIM_SPEC = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
@pytest.mark.parametrize("replicas", [1, 3])
@pytest.mark.parametrize("volume", ["emptyDir", "claim per worker", "shared claim"])
def test_per_worker_checkpoint_volumes_in_both_modes_and_the_storage_every_program_is_told(mode, replicas, volume):
    """Per-pod volumes are a storage of their own when several workers have one each: every rank and the config
    check are told (DS_CHECKPOINT_STORAGE, by train/checkpoint.py's rule), DeepSpeed writes the model states on
    every worker (checkpoint.use_node_local_storage), a Trainer saves on each node; a claim per worker is the
    StatefulSet's in ssh mode and a generic ephemeral volume of each pod in nossh mode."""
    from train import checkpoint

    checkpoints = {"emptyDir": {}, "claim per worker": {"volumeClaimSpec": CLAIM_SPEC},
                   "shared claim": {"existingClaim": "shared"}}[volume]
    values = {"launchMode": mode, "worker": {"replicas": replicas}, "checkpoints": checkpoints,
              "train": {"script": "/opt/train.py", "argsConvention": "huggingface"}}
    docs = render_chart(values)
    storage = checkpoint.storage_for(replicas, volume == "shared claim")
    told = [env_of(w) for w in by_kind(docs, "StatefulSet") + by_kind(docs, "Job") if "DS_CONFIG_PATH" in env_of(w)]
    assert told and {env["DS_CHECKPOINT_STORAGE"] for env in told} == {storage}  # the ranks, and the config check
    ds_config = json.loads(config_data(docs)["ds_config.json"])
    assert ds_config.get("checkpoint", {}).get("use_node_local_storage", False) == (storage == checkpoint.PER_WORKER)
    runs_program = [w for w in release_workloads(docs) if "--output_dir" in " ".join(container(w).get("args", []))]
    command = " ".join(container(runs_program[0])["args"])
    assert f"--save_on_each_node {str(storage == checkpoint.PER_WORKER).lower()}" in command, command
    if mode == "ssh":
        workers = one(docs, "StatefulSet", "-worker")
    else:
        workers = next(j for j in by_kind(docs, "Job") if "completionMode" in j["spec"])
    volume_of = {v["name"]: v for v in workers["spec"]["template"]["spec"]["volumes"]}.get("checkpoints")
    if volume == "claim per worker" and mode == "ssh":
        assert volume_of is None
        assert workers["spec"]["volumeClaimTemplates"][0]["spec"] == CLAIM_SPEC
    elif volume == "claim per worker":
        assert volume_of["ephemeral"]["volumeClaimTemplate"]["spec"] == CLAIM_SPEC
    else:
        assert ("persistentVolumeClaim" if volume == "shared claim" else "emptyDir") in volume_of


@pytest.mark.parametrize("convention", ["deepspeed", "none", "huggingface", "train"])
def test_a_plain_deepspeed_program_on_per_worker_volumes_has_every_node_mark_its_latest(convention):
    """DeepSpeed writes `latest` on global rank 0 alone: a program that resumes from it (deepspeed, none) gets every
    node's local rank 0 marking its own (podruntime/savehook.py, by DS_CHECKPOINT_MARK_LATEST); the train package
    and a Trainer with the chart's callback keep their own marks."""
    program = {"module": "train"} if convention == "train" else {"script": "/opt/train.py"}
    docs = render_chart({"worker": {"replicas": 2}, "train": {**program, "argsConvention": convention}})
    env = env_of(one(docs, "StatefulSet", "-worker"))
    assert env.get("DS_CHECKPOINT_STORAGE") == "per-worker", env
    assert env.get("DS_CHECKPOINT_MARK_LATEST") == ("node" if convention in ("deepspeed", "none") else None), env


def test_a_ds_config_against_the_checkpoint_storage_and_a_claim_made_from_others_data_are_refused():
    for checkpoints, value, expected in (({}, False, "every worker must write the model states"),
                                         ({"existingClaim": "c"}, True, "the same model-state files")):
        with pytest.raises(HelmError, match=expected):
            render_chart({"worker": {"replicas": 2}, "checkpoints": checkpoints, "deepspeed": {"config": {
                "train_micro_batch_size_per_gpu": 1, "checkpoint": {"use_node_local_storage": value}}}})
    for key in ("selector", "dataSource", "dataSourceRef"):
        spec = {**CLAIM_SPEC, key: {"matchLabels": {"a": "b"}} if key == "selector" else {
            "kind": "PersistentVolumeClaim", "name": "another-teams-checkpoints"}}
        with pytest.raises(HelmError, match=f"checkpoints.volumeClaimSpec.{key}: a checkpoint volume made from "
                                            "storage the release does not own"):
            render_chart({"checkpoints": {"volumeClaimSpec": spec}})


@pytest.mark.parametrize("account", [{"create": False}, {"create": False, "name": "default"},
                                     {"create": False, "name": "platform-trainer"}])
def test_the_scale_down_needs_the_releases_own_account(account):
    """Bound to a shared account, the scale Role would let every release running as it scale this one's workers to
    0: a shared account refuses the scale-down, and without it renders no Role at all."""
    with pytest.raises(HelmError) as err:
        render_chart({"serviceAccount": account})
    assert "launcher.scaleDownWorkers needs the release's own ServiceAccount (serviceAccount.create: true)" in \
        err.value.stderr and f'"{account.get("name", "default")}"' in err.value.stderr
    docs = render_chart({"serviceAccount": account, "launcher": {"scaleDownWorkers": False}})
    assert by_kind(docs, "Role") == by_kind(docs, "RoleBinding") == []
    with pytest.raises(HelmError, match="the progress sidecar scales the workers down"):
        render_chart({"progress": {"enabled": False}})


def test_shm_is_memory_backed_with_the_configured_size():
    sts, _ = workloads(render_chart({"worker": {"shmSize": "32Gi"}}))
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_component_scheduling_falls_back_to_global():
    values = {"global": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                         "priorityClassName": "high"},
              "launcher": {"nodeSelector": {"pool": "cpu"}}}
    sts, job = workloads(render_chart(values))
    worker_pod, launcher_pod = sts["spec"]["template"]["spec"], job["spec"]["template"]["spec"]
    assert worker_pod["nodeSelector"] == {"pool": "gpu"}
    assert launcher_pod["nodeSelector"] == {"pool": "cpu"}
    assert worker_pod["tolerations"] == launcher_pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert worker_pod["priorityClassName"] == launcher_pod["priorityClassName"] == "high"


def test_gang_scheduling_hooks():
    docs = render_chart({"worker": {"replicas": 5}, "scheduling": {
        "schedulerName": "volcano", "kueueQueueName": "team-a", "volcano": {"enabled": True, "queue": "q"}}})
    podgroup = one(docs, "PodGroup")
    assert podgroup["spec"] == {"minMember": 6, "queue": "q"}
    for workload in workloads(docs):
        assert workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        template = workload["spec"]["template"]
        assert template["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == podgroup["metadata"]["name"]
        assert template["spec"]["schedulerName"] == "volcano"
    assert by_kind(render_chart(), "PodGroup") == []
    sts, _ = workloads(render_chart({"scheduling": {"volcano": {"enabled": True}}}))
    assert sts["spec"]["template"]["spec"]["schedulerName"] == "volcano"  # the PodGroup needs Volcano


def test_launcher_job_knobs():
    _, job = workloads(render_chart({"job": {"backoffLimit": 1, "activeDeadlineSeconds": 3600,
                                             "ttlSecondsAfterFinished": 0, "waitTimeoutSeconds": 42}}))
    assert job["spec"]["backoffLimit"] == 1
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    assert job["spec"]["ttlSecondsAfterFinished"] == 0
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert env_of(job)["DS_WAIT_TIMEOUT_SECONDS"] == "42"
    _, job = workloads(render_chart())
    assert "activeDeadlineSeconds" not in job["spec"] and "ttlSecondsAfterFinished" not in job["spec"]


def test_long_release_names_keep_pod_names_valid_dns_labels():
    docs = render_chart(release="a-long-release-name-for-the-training-job-of-vision-ml")
    sts, _ = workloads(docs)
    assert len(sts["metadata"]["name"]) <= 52  # Kubernetes' limit for StatefulSets
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63


def test_pass_through_pod_settings():
    values = {"worker": {"podAnnotations": {"a": "1"}, "podLabels": {"team": "ml"},
                         "extraVolumes": [{"name": "cache", "emptyDir": {}}],
                         "extraVolumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                         "extraEnv": [{"name": "X", "value": "1"}],
                         "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                        "whenUnsatisfiable": "ScheduleAnyway"}]},
              "image": {"pullSecrets": ["regcred"], "tag": "v9", "pullPolicy": "Always"}}
    sts, job = workloads(render_chart(values))
    template = sts["spec"]["template"]
    assert template["metadata"]["annotations"]["a"] == "1"
    assert template["metadata"]["labels"]["team"] == "ml"
    assert {"name": "cache", "emptyDir": {}} in template["spec"]["volumes"]
    assert {"name": "cache", "mountPath": "/cache"} in container(sts)["volumeMounts"]
    assert env_of(sts)["X"] == "1"
    assert template["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    for workload in (sts, job):
        assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert container(workload)["image"] == "registry.example.com/ml/deepspeed-train:v9"
        assert container(workload)["imagePullPolicy"] == "Always"


def test_notes_say_how_to_follow_the_job():
    proc = subprocess.run([HELM, "install", "job", str(CHART), "--dry-run=client", "--namespace", "ml",
                           "--set", "image.repository=r/i", "--set", "worker.replicas=4", "--set",
                           "worker.gpusPerWorker=8"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "kubectl -n ml logs -f job/job-deepspeed-training-launcher-1" in proc.stdout
    assert "world size 32 = 4 workers x 8 GPUs" in proc.stdout
    assert "checkpoints: /checkpoints" in proc.stdout


# (values, text that helm 4 and helm 3 both print, naming the key)
BAD_VALUES = {
    "missing image": ({}, "repository"),
    "empty image": ({"image": {"repository": ""}}, "repository"),
    "zero replicas": ({"worker": {"replicas": 0}}, "replicas"),
    "negative replicas": ({"worker": {"replicas": -2}}, "replicas"),
    "replicas as string": ({"worker": {"replicas": "4"}}, "replicas"),
    "zero slots": ({"worker": {"gpusPerWorker": 0}}, "gpusPerWorker"),
    "float slots": ({"worker": {"gpusPerWorker": 1.5}}, "gpusPerWorker"),
    "unknown top-level key": ({"wrker": {"replicas": 2}}, "wrker"),
    "unknown worker key": ({"worker": {"replica": 2}}, "replica"),
    "bad gpu resource name": ({"worker": {"gpuResourceName": "nvidia.com/GPU!"}}, "gpuResourceName"),
    "bad shm size": ({"worker": {"shmSize": "lots"}}, "shmSize"),
    "privileged ssh port": ({"ssh": {"port": 22}}, "port"),
    "bad pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    "ds_config as string": ({"deepspeed": {"config": "{}"}}, "config"),
    "env without value": ({"env": [{"name": "A"}]}, "env"),
    "env with bad name": ({"env": [{"name": "A-B", "value": "x"}]}, "name"),
    "relative checkpoint path": ({"checkpoints": {"mountPath": "ckpt"}}, "mountPath"),
    "negative backoff": ({"job": {"backoffLimit": -1}}, "backoffLimit"),
    "zero wait timeout": ({"job": {"waitTimeoutSeconds": 0}}, "waitTimeoutSeconds"),
    "train args not a list": ({"train": {"args": "--steps 5"}}, "args"),
    "bad module name": ({"train": {"module": "my train"}}, "module"),
}


@pytest.mark.parametrize("helm", HELMS.values(), ids=HELMS.keys())
@pytest.mark.parametrize("case", BAD_VALUES, ids=BAD_VALUES.keys())
def test_bad_values_are_rejected_naming_the_key(case, helm):
    values, key = BAD_VALUES[case]
    with pytest.raises(HelmError) as err:
        render_chart(values, helm=helm, with_image=case not in ("missing image",))
    assert key in err.value.stderr, err.value.stderr


def test_an_image_digest_pins_the_image_by_content():
    digest = "sha256:" + "ab" * 32
    sts, job = workloads(render_chart({"image": {"tag": "v1", "digest": digest}}))
    for workload in (sts, job):
        assert container(workload)["image"] == f"registry.example.com/ml/deepspeed-train@{digest}"


def test_the_grafana_dashboard_configmap_is_the_charts_dashboard_file_and_off_by_default():
    assert [d for d in render_chart() if d["metadata"]["name"].endswith("-dashboard")] == []
    dashboard = one(render_chart({"progress": {"dashboard": True}}), "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["deepspeed-training.json"]) == \
        json.loads((CHART / "dashboards" / "deepspeed-training.json").read_text())


def test_a_monitor_without_an_output_path_writes_under_the_release_checkpoints():
    config = {"train_batch_size": 8, "tensorboard": {"enabled": True, "job_name": "run"},
              "csv_monitor": {"enabled": True, "output_path": "/data/own"}, "wandb": {"enabled": False}}
    rendered = json.loads(config_data(render_chart({"deepspeed": {"config": config}}))["ds_config.json"])
    assert rendered["tensorboard"] == {"enabled": True, "job_name": "run", "output_path": "/checkpoints/monitor/"}
    assert rendered["csv_monitor"]["output_path"] == "/data/own" and rendered["wandb"] == {"enabled": False}


def test_metrics_scrapers_name_labels_and_the_metrics_port_is_its_own():
    with pytest.raises(HelmError) as err:
        render_chart({"progress": {"metricsFrom": [{"podSelector": {"matchLabels": {"bad key": "x"}}}]}})
    assert 'progress.metricsFrom[0].podSelector.matchLabels: key "bad key" is not' in err.value.stderr
    for values, taken in (({"ssh": {"port": 9400}}, "ssh.port"), ({"deepspeed": {"masterPort": 9400}},
                                                                  "deepspeed.masterPort"),
                          ({"launchMode": "nossh", "deepspeed": {"masterPort": 9401}},
                           "the attempt loop's channel port (deepspeed.masterPort - 1)"),
                          ({"deepspeed": {"masterPort": 9401}}, "the attempt loop's channel port")):
        with pytest.raises(HelmError) as err:
            render_chart(values)
        assert f"progress.metricsPort: 9400 is also {taken}" in err.value.stderr


def test_a_platform_pins_the_sidecars_image_and_nothing_else_is_taken_as_one():
    pinned = "registry.example.com/platform/progress@sha256:" + "a" * 64
    for workload in workloads(render_chart({"progress": {"image": pinned}})):
        pod = workload["spec"]["template"]["spec"]
        assert pod["initContainers"][0]["image"] == pinned and pod["containers"][0]["image"] != pinned
    for hostile in ("evil\n  command: [sh]", "registry.example.com/progress", "a b:1", "x:1; rm -rf /"):
        with pytest.raises(HelmError) as err:
            render_chart({"progress": {"image": hostile}})
        assert "/progress/image" in err.value.stderr, hostile


def test_workers_past_deepspeeds_pdsh_fan_out_are_refused_in_ssh_mode_and_nossh_takes_4096():
    from deepspeed.launcher.constants import PDSH_MAX_FAN_OUT  # the owner of the chart's generated copy

    from train.deepspeed_mirror import PDSH_MAX_FAN_OUT as mirrored

    assert mirrored == PDSH_MAX_FAN_OUT
    assert len(config_data(render_chart({"worker": {"replicas": PDSH_MAX_FAN_OUT}}))["hostfile"].splitlines()) \
        == PDSH_MAX_FAN_OUT
    with pytest.raises(HelmError, match=rf"worker.replicas: {PDSH_MAX_FAN_OUT + 1} workers in launchMode ssh; "
                                        rf"DeepSpeed's pdsh runner starts at most {PDSH_MAX_FAN_OUT} hosts"):
        render_chart({"worker": {"replicas": PDSH_MAX_FAN_OUT + 1}})
    nossh = render_chart({"launchMode": "nossh", "worker": {"replicas": 4096}})
    assert len(config_data(nossh)["hostfile"].splitlines()) == 4096
    assert one(nossh, "Job", "-worker-r1")["spec"]["completions"] == 4096
    with pytest.raises(HelmError, match="worker.replicas"):
        render_chart({"launchMode": "nossh", "worker": {"replicas": 4097}})


def reserved_env_names() -> set[str]:
    """What the chart refuses in env, worker.extraEnv and extraEnvFrom prefixes: its own list and DeepSpeed's."""
    own = json.loads((CHART / "files" / "reserved-env.json").read_text())
    generated = json.loads((CHART / "files" / "generated" / "deepspeed.json").read_text())
    return {name for group, names in own.items() if group != "why" for name in names} | set(generated["launcherEnv"])


def test_every_env_name_the_chart_or_deepspeed_sets_is_reserved():
    import ast
    import inspect

    import deepspeed.launcher.launch as launch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from podruntime.rankstart import LAUNCHER_ENV
    reserved = reserved_env_names()
    # Every branch that adds env: both modes, hang detection, resumeFrom, GPUs, autotuning, the progress sidecar.
    user = {"env": [{"name": "APP_PLAIN", "value": "1"},
                    {"name": "APP_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "worker": {"extraEnv": [{"name": "APP_EXTRA", "value": "1"}]}}
    autotune = {"launcher": {"autotuning": "tune"}, "train": {"script": "/app/train.py", "argsConvention": "deepspeed"},
                "deepspeed": {"config": {"train_micro_batch_size_per_gpu": 4, "autotuning": {"fast": False}}}}
    renders = [render_chart({**autotune, **user, "hangDetection": {"enabled": True},
                             "checkpoints": {"existingClaim": "shared", "resumeFrom": "default/old"}}),
               render_chart({**user, "launchMode": "nossh", "hangDetection": {"enabled": True}})]
    set_by_chart = set()
    for docs in renders:
        for workload in [d for d in docs if d["kind"] in ("StatefulSet", "Job", "Deployment")]:
            spec = workload["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                set_by_chart |= {e["name"] for e in c.get("env", [])} - {"APP_PLAIN", "APP_SECRET", "APP_EXTRA"}
    assert {"DS_RESUME_FROM_DIR", "DS_AUTOTUNING_RESULTS", "DS_CHANNEL_PORT", "DS_HANG_STEP_SECONDS",
            "DS_GPUS_PER_WORKER"} <= set_by_chart  # the branches above were taken
    assert set_by_chart - reserved == set()
    # The pod runtime's env for the ranks: the ledger's attempt (protocol.ATTEMPT_ENV) and pdsh's (sshmode).
    from podruntime import protocol, sshmode

    assert set(protocol.ATTEMPT_ENV.values()) - reserved == set()
    exported = set(sshmode.pdsh_env({})) | {protocol.STATE_DIR_ENV, protocol.PROTOCOL_ENV}
    assert "PDSH_RCMD_TYPE" in exported and exported - reserved == set()
    # DeepSpeed's launcher: every `current_env[NAME] = ...` in its main(), the pinned version's own source, and
    # what the calls that get current_env set (only the accelerator's visible devices, and Popen, which runs it).
    assigned, calls = set(), set()
    for node in ast.walk(ast.parse(inspect.getsource(launch))):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) \
                and getattr(node.targets[0].value, "id", "") == "current_env":
            key = node.targets[0].slice
            assigned.add(key.value if isinstance(key, ast.Constant) else getattr(launch, key.id))
        if isinstance(node, ast.Call) and any(getattr(a, "id", "") == "current_env" for a in node.args):
            calls.add(getattr(node.func, "attr", getattr(node.func, "id", "")))
    assert calls == {"set_visible_devices_envs"}, calls
    for accelerator in (CUDA_Accelerator, CPU_Accelerator):  # the chart's GPU and CPU ranks
        assigned |= set(accelerator.visible_devices_envs(None))
    assert assigned - {"OMP_NUM_THREADS"} == set(LAUNCHER_ENV)  # OMP_NUM_THREADS: only with --bind_cores_to_rank
    assert set(LAUNCHER_ENV) <= reserved


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_the_peer_copy_is_on_for_per_worker_volumes_only_and_never_without_the_network_policy(mode):
    """One rule, the chart's (deepspeed-training.peerCopy): several workers without a shared claim, the value, and
    the NetworkPolicy that keeps the copies among the release's pods; its port beside the channel's, refused where
    it would be privileged."""
    def peer_port(values):
        docs = render_chart({"launchMode": mode, **values})
        worker = next(w for w in docs if w["kind"] in ("StatefulSet", "Job")
                      and w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker")
        ports = {p["name"]: p["containerPort"] for p in container(worker).get("ports", [])}
        assert ("peer-copy" in ports) == ("DS_PEER_COPY_PORT" in env_of(worker))
        return env_of(worker).get("DS_PEER_COPY_PORT")

    assert peer_port({"worker": {"replicas": 2}}) == "29498"  # deepspeed.masterPort - 2
    assert peer_port({"worker": {"replicas": 2}, "checkpoints": {"volumeClaimSpec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}}) == "29498"
    assert peer_port({"worker": {"replicas": 1}}) is None  # one worker: nothing to copy to
    assert peer_port({"worker": {"replicas": 2}, "checkpoints": {"existingClaim": "shared"}}) is None
    assert peer_port({"worker": {"replicas": 2}, "checkpoints": {"peerCopy": False}}) is None
    assert peer_port({"worker": {"replicas": 2}, "networkPolicy": {"enabled": False},
                      "allowSecurityRelaxations": True}) is None
    with pytest.raises(HelmError, match="leaves no unprivileged port for the peer copy"):
        render_chart({"launchMode": mode, "worker": {"replicas": 2}, "deepspeed": {"masterPort": 1026}})
    with pytest.raises(HelmError, match="is also the peer copy's port"):
        render_chart({"launchMode": mode, "worker": {"replicas": 2}, "progress": {"metricsPort": 29498}})
