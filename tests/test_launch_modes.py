"""Render tests of the two launch modes (ssh, nossh) and of the gang-scheduling objects: what each mode creates,
what it leaves out, and how its pods find each other. The e2e tier (tests/e2e/test_nossh.py) runs them."""

import pytest

from tests.support.chart import (
    CHART,
    HelmError,
    by_kind,
    container,
    env_of,
    is_hook,
    one,
    release_workloads,
    render_chart,
)

NOSSH = {"launchMode": "nossh", "checkpoints": {"existingClaim": "ckpt"}}
GANG_APIS = ["scheduling.k8s.io/v1alpha1", "scheduling.k8s.io/v1alpha2", "scheduling.k8s.io/v1beta1"]


def workers_job(docs: list[dict]) -> dict:
    return one(docs, "Job", "-worker-r1")


def test_nossh_renders_no_ssh_no_launcher_no_token():
    docs = render_chart(NOSSH)
    kinds = sorted(d["kind"] for d in docs if not is_hook(d))
    assert kinds == ["ConfigMap", "ConfigMap", "ConfigMap", "Job", "NetworkPolicy", "Role", "RoleBinding",
                     "Service", "ServiceAccount"]  # Role: the progress sidecar's (tests/test_chart.py)
    scripts = one(docs, "ConfigMap", "-scripts")
    package = {f"podruntime.{p.name}" for p in (CHART / "files" / "podruntime").glob("*.py")}
    assert set(scripts["data"]) == {"__main__.py", "rank-log.py", "rank-hook.py", *package}  # no sshd, no ssh setup
    text = str([d for d in docs if d is not scripts]).replace("podruntime/sshmode.py", "").replace(
        "podruntime.sshmode.py", "")  # the whole package ships; nothing of the ssh mode runs
    assert "ssh" not in text.replace("nossh", "").replace("--no_ssh", "")
    assert [p["port"] for p in one(docs, "Service")["spec"]["ports"]] == [29500]
    config = one(docs, "ConfigMap", "-config")["data"]
    assert set(config) == {"ds_config.json", "train_config.json", "hostfile"}
    job = workers_job(docs)
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    assert [p["name"] for p in container(job)["ports"]] == ["rendezvous", "channel"]
    assert [p["containerPort"] for p in container(job)["ports"]] == [29500, 29499]
    assert "readinessProbe" not in container(job)


def test_nossh_pods_pass_the_restricted_profile_with_no_opt_in():
    docs = render_chart(NOSSH)
    job = workers_job(docs)
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    ctx = container(job)["securityContext"]
    assert ctx == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                   "readOnlyRootFilesystem": True}
    assert "deepspeed-training/security-relaxations" not in job["spec"]["template"]["metadata"]["annotations"]
    assert all(set(v) & {"configMap", "emptyDir", "persistentVolumeClaim"} or v["name"] == "progress-token"
               for v in pod["volumes"])
    assert one(docs, "NetworkPolicy")


def test_nossh_workers_are_an_indexed_job_that_finds_worker_0_through_the_headless_service():
    docs = render_chart({**NOSSH, "worker": {"replicas": 3, "gpusPerWorker": 2}})
    job, service = workers_job(docs), one(docs, "Service")
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    domain = f"{service['metadata']['name']}.default.svc.cluster.local"
    hosts = [f"job-deepspeed-training-worker-r1-{i}.{domain} slots=2" for i in range(3)]
    assert one(docs, "ConfigMap", "-config")["data"]["hostfile"] == "\n".join(hosts) + "\n"
    args = container(job)["args"]
    assert args[:5] == ["deepspeed", "--hostfile=/etc/deepspeed/config/hostfile", "--no_ssh",
                        f"--master_addr=job-deepspeed-training-worker-r1-0.{domain}", "--master_port=29500"]
    assert container(job)["command"] == ["python3", "-I", "/etc/deepspeed/scripts", "nossh-worker"]
    assert env_of(job)["DS_WORLD_SIZE"] == "6" and env_of(job)["DS_CHANNEL_PORT"] == "29499"


def test_nossh_env_reaches_the_ranks_as_pod_env():
    env = [{"name": "MARKER", "value": "x"}, {"name": "TOKEN_FILE", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}}}]
    docs = render_chart({**NOSSH, "env": env})
    assert env_of(workers_job(docs))["MARKER"] == "x"
    assert env_of(workers_job(docs))["TOKEN_FILE"] == {"secretKeyRef": {"name": "s", "key": "k"}}
    ssh = render_chart({"env": env})
    assert "MARKER" not in env_of(one(ssh, "StatefulSet"))  # ssh mode: through .deepspeed_env
    assert one(ssh, "ConfigMap", "-config")["data"]["deepspeed_env"] == "MARKER=x\n"


def test_both_modes_retry_runs_in_the_pods_and_fail_the_job_on_a_configuration_error():
    for docs, job, main in ((render_chart(), "-launcher-1", "launcher"), (render_chart(NOSSH), "-worker-r1", "worker")):
        spec = one(docs, "Job", job)["spec"]
        assert spec["podFailurePolicy"]["rules"][1] == {
            "action": "FailJob", "onExitCodes": {"containerName": main, "operator": "In", "values": [2, 3]}}
        assert env_of(one(docs, "Job", job))["DS_RUN_RETRIES"] == "2"


def test_one_collective_timeout_reaches_every_program_in_both_modes():
    for mode, workload in ((NOSSH, workers_job), ({}, lambda docs: one(docs, "StatefulSet"))):
        assert env_of(workload(render_chart(mode)))["DEEPSPEED_TIMEOUT"] == "10"  # DeepSpeed 0.19.8's own default
        assert env_of(workload(render_chart({**mode, "deepspeed": {"collectiveTimeoutMinutes": 3}})))[
            "DEEPSPEED_TIMEOUT"] == "3"
    # A Trainer passes its own ddp_timeout (30 minutes) to the process group: the convention passes ours.
    docs = render_chart({"train": {"argsConvention": "huggingface", "script": "/app/p.py"},
                         "deepspeed": {"collectiveTimeoutMinutes": 3}})
    args = container(one(docs, "Job"))["args"]
    assert args[args.index("--ddp_timeout") + 1] == "180"


@pytest.mark.parametrize("values, message", [
    ({"deepspeed": {"collectiveTimeoutMinutes": 0}}, "collectiveTimeoutMinutes"),
    ({"deepspeed": {"collectiveTimeoutMinutes": "10"}}, "collectiveTimeoutMinutes"),
    ({"deepspeed": {"collectiveTimeoutMinutes": None}}, "collectiveTimeoutMinutes"),
    ({"env": [{"name": "DEEPSPEED_TIMEOUT", "value": "1"}]}, "DEEPSPEED_TIMEOUT"),
])
def test_the_collective_timeout_has_one_owner(values, message):
    with pytest.raises(HelmError) as err:
        render_chart(values)
    assert message in err.value.stderr


def test_a_failed_pod_of_either_mode_says_why_in_its_termination_message():
    for docs, job in ((render_chart(), "-launcher-1"), (render_chart(NOSSH), "-worker-r1")):
        assert container(one(docs, "Job", job))["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_hang_watchdog_gets_its_budgets_in_both_modes_and_goes_when_disabled():
    for mode, workload in ((NOSSH, workers_job), ({}, lambda docs: one(docs, "StatefulSet"))):
        env = env_of(workload(render_chart({**mode, "hangDetection": {"stepSeconds": 30}})))
        assert (env["DS_HANG_DETECTION"], env["DS_HANG_STARTUP_SECONDS"], env["DS_HANG_STEP_SECONDS"]) == (
            "on", "300", "30")
        off = env_of(workload(render_chart({**mode, "hangDetection": {"enabled": False}})))
        assert off["DS_HANG_DETECTION"] == "off" and "DS_HANG_STEP_SECONDS" not in off  # the one switch
        assert "podruntime.watchdog.py" in one(render_chart(mode), "ConfigMap", "-scripts")["data"]


@pytest.mark.parametrize("values, message", [
    ({"hangDetection": {"stepSeconds": 5}}, "stepSeconds"),
    ({"hangDetection": {"startupSeconds": "300"}}, "startupSeconds"),
    ({"hangDetection": None}, "hangDetection"),
    ({"hangDetection": {"enabled": True, "every": 3}}, "every"),
    ({"env": [{"name": "DS_RUN_ID", "value": "x"}]}, "DS_RUN_ID"),
])
def test_hang_detection_mistakes_stop_at_render(values, message):
    with pytest.raises(HelmError) as err:
        render_chart(values)
    assert message in err.value.stderr


def test_the_ssh_launcher_waits_for_the_current_worker_template():
    base = render_chart()
    sts, job = one(base, "StatefulSet"), one(base, "Job")
    assert env_of(sts)["DS_WORKER_TEMPLATE"] == env_of(job)["DS_WORKER_TEMPLATE"]
    # A change to the workers changes the hash; one to the launcher alone does not.
    worker_change = render_chart({"worker": {"shmSize": "2Gi"}})
    launcher_change = render_chart({"job": {"waitTimeoutSeconds": 30}})
    assert env_of(one(worker_change, "Job"))["DS_WORKER_TEMPLATE"] != env_of(job)["DS_WORKER_TEMPLATE"]
    assert env_of(one(launcher_change, "Job"))["DS_WORKER_TEMPLATE"] == env_of(job)["DS_WORKER_TEMPLATE"]


@pytest.mark.parametrize("api", GANG_APIS)
@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_native_gang_objects_follow_the_cluster_api(api, mode, monkeypatch):
    values = {"launchMode": mode, "checkpoints": {"existingClaim": "ckpt"}, "worker": {"replicas": 3},
              "scheduling": {"gangScheduling": True}}
    docs = render_chart(values, api_versions=[f"{api}/Workload"])
    workload = one(docs, "Workload")
    assert workload["apiVersion"] == api
    gang = 3 + (1 if mode == "ssh" else 0)
    pods = [d["spec"]["template"]["spec"] for d in release_workloads(docs)]
    assert len(pods) == (2 if mode == "ssh" else 1)
    if api.endswith("v1alpha1"):
        assert workload["spec"]["podGroups"] == [{"name": "gang", "policy": {"gang": {"minCount": gang}}}]
        assert not by_kind(docs, "PodGroup")
        assert all(p["workloadRef"] == {"name": "job-deepspeed-training", "podGroup": "gang"} for p in pods)
    else:
        assert workload["spec"]["podGroupTemplates"] == [
            {"name": "gang", "schedulingPolicy": {"gang": {"minCount": gang}}}]
        group = one(docs, "PodGroup")
        assert group["apiVersion"] == api and group["spec"]["schedulingPolicy"] == {"gang": {"minCount": gang}}
        ref = {"workloadName": "job-deepspeed-training"}
        if api.endswith("v1alpha2"):
            assert group["spec"]["podGroupTemplateRef"] == {"workload": {**ref, "podGroupTemplateName": "gang"}}
        else:
            assert group["spec"]["workloadRef"] == {**ref, "templateName": "gang"}
        assert all(p["schedulingGroup"] == {"podGroupName": "job-deepspeed-training"} for p in pods)


def test_the_newest_gang_api_wins_and_none_is_refused():
    values = {"scheduling": {"gangScheduling": True}}
    docs = render_chart(values, api_versions=[f"{api}/Workload" for api in GANG_APIS])
    assert one(docs, "Workload")["apiVersion"] == "scheduling.k8s.io/v1beta1"
    with pytest.raises(HelmError, match="scheduling.gangScheduling: the cluster serves no scheduling.k8s.io Workload"):
        render_chart(values)
    assert not by_kind(render_chart(), "Workload")


def test_volcano_gang_covers_the_pods_of_each_mode():
    volcano = {"scheduling": {"volcano": {"enabled": True}}, "worker": {"replicas": 3}}
    assert one(render_chart(volcano), "PodGroup")["spec"]["minMember"] == 4
    assert one(render_chart({**volcano, **NOSSH}), "PodGroup")["spec"]["minMember"] == 3


def test_kueue_queue_and_rank_ordered_topology_go_on_the_workers():
    kueue = {"scheduling": {"kueueQueueName": "team-a", "kueueTopology": {
        "mode": "required", "level": "cloud.provider.com/topology-rack"}}}
    for docs in (render_chart(kueue), render_chart({**kueue, **NOSSH})):
        for workload in release_workloads(docs):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            annotations = workload["spec"]["template"]["metadata"]["annotations"]
            assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
            is_worker = labels["app.kubernetes.io/component"] == "worker"
            assert (annotations.get("kueue.x-k8s.io/podset-required-topology")
                    == ("cloud.provider.com/topology-rack" if is_worker else None))


@pytest.mark.parametrize("values, message", [
    ({**NOSSH, "deepspeed": {"masterPort": 1024}}, "deepspeed.masterPort: 1024 leaves no unprivileged port for the "
     "attempt loop's channel"),
    ({"ssh": {"port": 29499}}, "ssh.port: 29499 is also the attempt loop's channel port (deepspeed.masterPort - 1)"),
    ({"scheduling": {"kueueTopology": {"mode": "required", "level": ""}, "kueueQueueName": "q"}},
     "scheduling.kueueTopology: mode \"required\" and level \"\" go together"),
    ({"scheduling": {"kueueTopology": {"mode": "preferred", "level": "rack"}}},
     "scheduling.kueueTopology needs scheduling.kueueQueueName"),
    ({"scheduling": {"gangScheduling": True, "volcano": {"enabled": True}}}, "two gang schedulers"),
    ({"launchMode": "mpi"}, "/launchMode"),
])
def test_launch_mode_mistakes_stop_at_render(values, message):
    with pytest.raises(HelmError) as err:
        render_chart(values, api_versions=["scheduling.k8s.io/v1alpha2/Workload"])
    assert message in err.value.stderr


AUTOTUNE = {"launcher": {"autotuning": "tune"}, "train": {"script": "/app/train.py",
                                                          "argsConvention": "deepspeed"},
            "checkpoints": {"existingClaim": "shared"}}


def test_autotuning_runs_the_tuner_over_ssh_and_writes_to_the_checkpoint_volume():
    import json
    docs = render_chart({**AUTOTUNE, "deepspeed": {"config": {
        "train_micro_batch_size_per_gpu": 4, "autotuning": {"metric": "throughput", "fast": False}}}})
    args = container(one(docs, "Job"))["args"]
    assert "--autotuning=tune" in args and args.index("--autotuning=tune") < args.index("/app/train.py")
    assert args[args.index("/app/train.py") + 1:][:3] == ["--deepspeed", "--deepspeed_config",
                                                              "/etc/deepspeed/config/ds_config.json"]
    tuned = json.loads(one(docs, "ConfigMap", "-config")["data"]["ds_config.json"])["autotuning"]
    assert tuned == {"enabled": True, "metric": "throughput", "fast": False, "overwrite": False,
                     "results_dir": "/checkpoints/autotuning/results", "exps_dir": "/checkpoints/autotuning/exps"}
    launcher = one(docs, "Job")["spec"]["template"]["spec"]
    mount = next(m for m in container(one(docs, "Job"))["volumeMounts"] if m["name"] == "checkpoints")
    assert mount == {"name": "checkpoints", "mountPath": "/checkpoints", "subPath": "default/job"}
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared"}} in launcher["volumes"]
    plain = json.loads(one(render_chart(), "ConfigMap", "-config")["data"]["ds_config.json"])
    assert "autotuning" not in plain and "--autotuning=tune" not in container(one(render_chart(), "Job"))["args"]


@pytest.mark.parametrize("values, message", [
    ({**AUTOTUNE, **NOSSH}, "launcher.autotuning needs launchMode ssh"),
    ({**AUTOTUNE, "train": {"script": "/app/t.py", "argsConvention": "train"}},
     "launcher.autotuning: DeepSpeed's autotuner finds the ds_config after --deepspeed_config or --deepspeed"),
    ({**AUTOTUNE, "train": {"module": "mypkg.train", "argsConvention": "deepspeed"}},
     "launcher.autotuning: DeepSpeed's autotuner drops --module from its experiments"),
    ({**AUTOTUNE, "checkpoints": {}}, "launcher.autotuning: the autotuner in the launcher pod reads the results"),
    *[({**AUTOTUNE, "deepspeed": {"config": {"train_micro_batch_size_per_gpu": 4, "autotuning": {key: value}}}},
       f"deepspeed.config.autotuning.{key}: set by the chart")
      for key, value in (("exps_dir", "/checkpoints"), ("results_dir", "/tmp/r"), ("enabled", True),
                         ("metric_path", "/checkpoints/m.json"), ("model_info_path", "/x.json"))],
    ({"launcher": {"autotuning": "sweep"}}, "/launcher/autotuning"),
    ({"launcher": {"autotuning": "run"}}, "/launcher/autotuning"),  # stops early and reports success
])
def test_autotuning_mistakes_stop_at_render(values, message):
    with pytest.raises(HelmError) as err:
        render_chart(values)
    assert message in err.value.stderr


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_the_ranks_learn_how_many_gpus_their_worker_was_given_only_when_it_was_given_some(mode):
    gpus = render_chart({"launchMode": mode, "worker": {"gpusPerWorker": 4}})
    cpus = render_chart({"launchMode": mode, "worker": {"gpusPerWorker": 4, "gpuResourceName": ""}})
    worker = [d for d in release_workloads(gpus) if d["spec"]["template"]["metadata"]["labels"][
        "app.kubernetes.io/component"] == "worker"][0]
    assert env_of(worker)["DS_GPUS_PER_WORKER"] == "4"
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert all("DS_GPUS_PER_WORKER" not in env_of(d) for d in release_workloads(cpus))


def test_the_rocm_values_request_amd_gpus_and_hand_rccl_its_settings():
    docs = render_chart(values_files=[CHART / "ci" / "11-rocm-values.yaml"])
    worker = one(docs, "StatefulSet", "-worker")
    assert container(worker)["resources"]["limits"] == {"amd.com/gpu": 8}
    assert env_of(worker)["DS_GPUS_PER_WORKER"] == "8"
    ranks_env = one(docs, "ConfigMap", "-config")["data"]["deepspeed_env"].splitlines()  # pasted on every rank
    assert {"NCCL_SOCKET_IFNAME=eth0", "NCCL_IGNORE_CPU_AFFINITY=1", "HSA_FORCE_FINE_GRAIN_PCIE=1"} <= set(ranks_env)
    assert "0.1.0-rocm" in container(worker)["image"]
