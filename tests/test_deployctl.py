"""scripts/deployctl/: layering, derived fields, validation before anything reaches a cluster."""

import json
import shutil
import subprocess

import pytest

from scripts import deployctl
from tests.support.chart import HELM, ROOT, render_chart
from tests.support.glue_tree import edit, run, set_key, write
from tests.support.shm import release_shm_buffers
from train import checkpoint

ENVS = ["dev", "staging", "prod"]


@pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")
@pytest.mark.parametrize("project", [None, "example"])
@pytest.mark.parametrize("env", ENVS)
def test_every_shipped_env_renders_values_that_helm_accepts(env, project):
    r = deployctl.build(env, project)
    deployctl.write(r)
    docs = render_chart(values_files=[r.out / "values.yaml"], with_image=False)
    config = json.loads(next(d for d in docs if d["metadata"]["name"].endswith("-config"))["data"]["ds_config.json"])
    assert json.loads((r.out / "ds_config.json").read_text()) == r.ds_config
    # What the chart adds for per-worker checkpoint volumes (every worker writes the model states its ranks load).
    chart = r.effective
    storage = checkpoint.storage_for(chart["worker"]["replicas"], bool(chart["checkpoints"]["existingClaim"]))
    pinned = {"checkpoint": {"use_node_local_storage": True}} if storage == checkpoint.PER_WORKER else {}
    assert config == {**r.ds_config, **pinned}
    micro, accum, total = r.batch
    assert config["train_batch_size"] == total == micro * accum * r.world_size
    hostfile = next(d for d in docs if d["metadata"]["name"].endswith("-config"))["data"]["hostfile"]
    assert len(hostfile.splitlines()) == r.effective["worker"]["replicas"]


def test_layers_apply_in_order_maps_merge_lists_replace(tree):
    edit(tree / "values" / "base.yaml", lambda d: d["chart"].update(env=[{"name": "A", "value": "base"}]))
    edit(tree / "values" / "prod.yaml", lambda d: d["chart"]["worker"].update(replicas=4))
    edit(tree / "values" / "projects" / "example" / "values.yaml",
         lambda d: d["chart"].update(env=[{"name": "B", "value": "project"}]))
    (tree / "values" / "projects" / "example" / "prod.yaml").write_text("chart:\n  worker:\n    gpusPerWorker: 4\n")
    r = deployctl.build("prod", "example")
    assert r.sources[-1] == "values/projects/example/prod.yaml"
    assert r.chart["worker"]["replicas"] == 4  # from prod.yaml
    assert r.chart["worker"]["gpusPerWorker"] == 4  # from the project's prod.yaml
    assert r.chart["worker"]["shmSize"] == "64Gi"  # prod.yaml's, merged beside the others
    assert r.chart["env"] == [{"name": "B", "value": "project"}]  # lists replace
    assert r.chart["image"]["repository"] == "registry.example.com/ml/deepspeed-train"  # from base.yaml


def test_global_batch_derives_the_accumulation(tree):
    edit(tree / "values" / "prod.yaml", lambda d: d["deepspeed"].update(globalBatch=2048, microBatch=2))
    r = deployctl.build("prod", None)
    assert r.world_size == 64
    assert r.batch == (2, 16, 2048)
    assert (r.ds_config["train_micro_batch_size_per_gpu"], r.ds_config["gradient_accumulation_steps"],
            r.ds_config["train_batch_size"]) == (2, 16, 2048)


def test_overrides_merge_over_the_preset(tree):
    edit(tree / "values" / "staging.yaml", lambda d: d["deepspeed"].update(
        overrides={"zero_optimization": {"reduce_bucket_size": 1000}, "wall_clock_breakdown": True}))
    r = deployctl.build("staging", None)
    assert r.ds_config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert r.ds_config["zero_optimization"]["stage"] == 2
    assert r.ds_config["wall_clock_breakdown"] is True


def test_plan_shows_the_job_and_warns_when_model_states_exceed_gpu_memory(tree, capsys):
    code, out, _ = run("plan", "--env", "prod", "--project", "example", capsys=capsys)
    assert code == 0
    assert "workers     8 x 8 nvidia.com/gpu = world size 64" in out
    assert "batch       micro 4 x accumulation 4 x 64 data-parallel ranks = global 1024" in out
    assert "ZeRO stage 2, bf16" in out and "354.9M parameters" in out and "kube context prod" in out
    assert "WARNING" not in out
    edit(tree / "values" / "projects" / "example" / "values.yaml",
         lambda d: d["chart"]["train"]["config"]["model"].update(n_layer=48, d_model=6144, n_head=48))
    edit(tree / "values" / "prod.yaml", lambda d: d["deepspeed"].update(gpuMemoryGiB=40))
    code, out, _ = run("plan", "--env", "prod", "--project", "example", capsys=capsys)
    assert code == 0
    assert "WARNING: model states need" in out and "GPUs have 40 GiB" in out


def test_plan_shows_the_pipeline_layout_and_counts_data_parallel_ranks_in_the_batch(tree, capsys):
    set_key("dev.yaml", "chart", "train", "config", "model", "pipeline_stages", 2)(tree)
    set_key("dev.yaml", "deepspeed", "overrides", {"zero_optimization": {"stage": 1}})(tree)
    set_key("dev.yaml", "chart", "worker", "replicas", 4)(tree)
    # A stage's layers are written by one data-parallel rank: per-worker volumes could not resume them.
    code, out, err = run("plan", "--env", "dev", capsys=capsys)
    assert code == 1 and err.strip() == (
        "error: values/dev.yaml: chart.worker.replicas 4: model.pipeline_stages 2 with per-worker checkpoint volumes "
        "(several workers, no checkpoints.existingClaim): DeepSpeed writes each stage's layers from one data-parallel "
        "rank only, so the other workers could not resume; give the release a shared claim"), err
    set_key("dev.yaml", "chart", "checkpoints", "existingClaim", "checkpoints-dev")(tree)
    code, out, err = run("plan", "--env", "dev", capsys=capsys)
    assert code == 0, err
    assert "micro 4 x accumulation 1 x 2 data-parallel ranks (4 ranks / 2 pipeline stages) = global 8" in out
    assert "layout      2 pipeline stages x 2 data-parallel ranks" in out
    assert "stage 0     TokenEmbedding, AddPositions, Block:" in out
    assert "stage 1     Block, LayerNorm, TokenEmbedding:" in out


def test_deploy_dry_run_prints_the_helm_command_with_the_rendered_values():
    proc = subprocess.run(["make", "deploy", "ENV=dev", "PROJECT=example", "DRY_RUN=1"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "DRY_RUN: not applied" in proc.stdout
    assert (f"helm upgrade --install example {ROOT}/charts/deepspeed-training -f {ROOT}/build/example/dev/values.yaml "
            "--namespace ml-dev") in proc.stdout
    assert "StatefulSet      ml-dev/example-deepspeed-training-worker" in proc.stdout
    assert "+ then up to 30s for the pods of release example to run (each that cannot says why)" in proc.stdout


def test_deploy_is_refused_to_a_context_prod_does_not_name(tree, capsys):
    code, _, err = run("deploy", "--env", "prod", "--project", "example", "--kube-context", "kind-dev", "--dry-run",
                       capsys=capsys)
    assert code == 1
    assert "values/prod.yaml: deploy.kubeContexts allows ['prod']; refusing to deploy ENV=prod to kube context " \
           "'kind-dev'" in err
    code, out, _ = run("deploy", "--env", "prod", "--project", "example", "--dry-run", capsys=capsys)
    assert code == 0 and "--kube-context prod" in out


def test_make_targets_guard_their_variables():
    proc = subprocess.run(["make", "render"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "ENV is required" in proc.stderr and "dev prod staging" in proc.stderr
    proc = subprocess.run(["make", "deploy", "ENV=prod"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "PROJECT is required for deploy" in proc.stderr


@pytest.fixture
def demo_shm_buffers():
    """The demo's ranks run on DeepSpeed's default port, which no other test uses on this machine; a program that
    does not release its /dev/shm buffer (the HF example) leaves it, and the session's clean-up takes only the
    ports it handed out (tests/conftest.py)."""
    yield
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT  # noqa: PLC0415 - imports deepspeed

    release_shm_buffers({TORCH_DISTRIBUTED_DEFAULT_PORT})


@pytest.mark.usefixtures("demo_shm_buffers")
def test_make_demo_runs_the_dev_render_as_a_local_deepspeed_job():
    shutil.rmtree(ROOT / "build" / "demo", ignore_errors=True)
    proc = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--ds-config=" + str(ROOT / "build/base/dev/ds_config.json") in proc.stdout
    assert "[rank 0] INFO step 40/40" in proc.stdout
    assert "collective timeout 2 min" in proc.stdout  # values/dev.yaml's, as the pods would get it
    assert "demo: done; checkpoints in build/demo/base/checkpoints" in proc.stdout
    assert json.loads((ROOT / "build/demo/base/checkpoints/metrics.json").read_text())["steps"] == 40


@pytest.mark.usefixtures("demo_shm_buffers")
def test_make_demo_runs_a_projects_own_program():
    shutil.rmtree(ROOT / "build" / "demo" / "hf-example", ignore_errors=True)
    proc = subprocess.run(["make", "demo", "PROJECT=hf-example"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{ROOT}/examples/hf_trainer.py --use_cpu" in proc.stdout  # the project's own arguments, then the chart's
    assert f"--deepspeed {ROOT}/build/hf-example/dev/ds_config.json --output_dir {ROOT}/build/demo/hf-example" \
        in proc.stdout
    assert "hf_trainer: done at global step 20" in proc.stdout
    assert (ROOT / "build/demo/hf-example/checkpoints/checkpoint-20").is_dir()


# ---- bad input: each error names the file, the key and what was expected

BAD = {
    "unknown ENV": (None, ["--env", "qa"], "ENV=qa: no values/qa.yaml; environments: dev, prod, staging"),
    "unknown PROJECT": (None, ["--env", "dev", "--project", "nope"],
                        "PROJECT=nope: no values/projects/nope/; projects: example"),
    "YAML syntax error": (write("values/dev.yaml", "deploy:\n  namespace: ml-dev\n chart: [\n"), ["--env", "dev"],
                          "values/dev.yaml:3:2: YAML syntax error"),
    "top level not a mapping": (write("values/dev.yaml", "- a\n- b\n"), ["--env", "dev"],
                                "values/dev.yaml: expected a mapping at the top level, got list"),
    "wrong type": (set_key("staging.yaml", "deepspeed", "microBatch", "4"), ["--env", "staging"],
                   "values/staging.yaml: deepspeed.microBatch: '4' is not of type 'integer'"),
    "unknown settings key": (set_key("prod.yaml", "deepspeed", "presett", "x"), ["--env", "prod"],
                             "values/prod.yaml: deepspeed: Additional properties are not allowed ('presett'"),
    "negative learning rate": (set_key("dev.yaml", "deepspeed", "lr", -1), ["--env", "dev"],
                               "values/dev.yaml: deepspeed.lr: -1 is less than or equal to the minimum of 0"),
    "bad release name": (set_key("projects/example/values.yaml", "deploy", "release", "My_Job"),
                         ["--env", "dev", "--project", "example"],
                         "values/projects/example/values.yaml: deploy.release: the Helm release"),
    "global batch not a multiple": (set_key("prod.yaml", "deepspeed", "globalBatch", 1000), ["--env", "prod"],
                                    "values/prod.yaml: deepspeed.globalBatch 1000 must be a multiple of "
                                    "deepspeed.microBatch 4 x 64 data-parallel ranks (8 workers x 8 GPUs)"),
    "unknown preset": (set_key("dev.yaml", "deepspeed", "preset", "zero9"), ["--env", "dev"],
                       "values/dev.yaml: deepspeed.preset 'zero9': "),
    "missing template variable": (write("templates/ds_config/cpu-fp32.json.j2", '{"a": {{ micro_batchh }}}'),
                                  ["--env", "dev"], "'micro_batchh' is undefined"),
    "unknown top-level ds_config key": (
        set_key("dev.yaml", "deepspeed", "overrides", {"trian_batch_size": 8}), ["--env", "dev"],
        "ds_config templates/ds_config/cpu-fp32.json.j2 + deepspeed.overrides from values/dev.yaml: unknown "
        "top-level key 'trian_batch_size' (did you mean 'train_batch_size'?)"),
    "unknown key inside a ds_config section": (
        set_key("dev.yaml", "deepspeed", "overrides", {"zero_optimization": {"stgae": 3}}), ["--env", "dev"],
        "DeepSpeed rejects it: ValidationError: DeepSpeedZeroConfig.stgae: Extra inputs are not permitted"),
    "ds_config batch mismatch": (
        set_key("dev.yaml", "deepspeed", "overrides", {"train_batch_size": 12}), ["--env", "dev"],
        "train_batch_size 12 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x 2 data-parallel "
        "ranks"),
    "chart value of the wrong type": (set_key("prod.yaml", "chart", "worker", "replicas", "8"), ["--env", "prod"],
                                      "values/prod.yaml: chart.worker.replicas: '8' is not of type 'integer'"),
    "unknown chart key": (set_key("projects/example/values.yaml", "chart", "worker", "replica", 2),
                          ["--env", "dev", "--project", "example"],
                          "values/projects/example/values.yaml: chart.worker: Additional properties are not "
                          "allowed ('replica'"),
    "unknown train config key": (set_key("dev.yaml", "chart", "train", "config", "stepz", 5), ["--env", "dev"],
                                 "chart.train.config: unknown key 'stepz'"),
    "bad model shape": (set_key("dev.yaml", "chart", "train", "config", "model", "d_model", 65), ["--env", "dev"],
                        "model.d_model must be a multiple of model.n_head (4), got 65"),
    "pipeline stages that do not divide the world": (
        set_key("dev.yaml", "chart", "train", "config", "model", "pipeline_stages", 3), ["--env", "dev"],
        "values/dev.yaml: chart.train.config.model.pipeline_stages: model.pipeline_stages 3 must divide the world "
        "size 2"),
    "pipeline with ZeRO-2": (set_key("dev.yaml", "chart", "train", "config", "model", "pipeline_stages", 2),
                             ["--env", "dev"], "supports ZeRO stage 0 and 1 only"),
    "a project forbidding itself nothing: resumeAcrossWorldSizes is the platform's": (
        set_key("projects/example/values.yaml", "chart", "checkpoints", "resumeAcrossWorldSizes", True),
        ["--env", "dev", "--project", "example"],
        "values/projects/example/values.yaml: chart.checkpoints.resumeAcrossWorldSizes: whether a job may resume on "
        "another world size is the platform's to set"),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_bad_input_is_refused_before_anything_is_applied(tree, capsys, case):
    breaks, args, message = BAD[case]
    if breaks:
        breaks(tree)
    code, out, err = run("deploy", *args, "--dry-run", capsys=capsys)
    assert code == 1
    assert message in err, err
    assert "helm upgrade" not in out


@pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")
def test_a_hostile_env_value_is_refused_by_the_chart_before_deploy(tree, capsys):
    set_key("dev.yaml", "chart", "env", [{"name": "X", "value": "$(curl evil)"}])(tree)
    code, out, err = run("deploy", "--env", "dev", "--dry-run", capsys=capsys)
    assert code == 1
    assert "env[0] (X): value" in err and "helm upgrade" not in out


def test_status_reads_the_release_progress_configmap_or_says_in_one_line_why_not(tree, capsys, tmp_path,
                                                                                  monkeypatch):
    code, out, _ = run("status", "--env", "dev", "--project", "example", "--dry-run", capsys=capsys)
    assert code == 0
    assert "+ kubectl --namespace ml-dev get configmap example-deepspeed-training-progress -o " \
           "'jsonpath={.data.summary}'" in out
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))  # no cluster: one line, no traceback
    code, _, err = run("status", "--env", "dev", "--project", "example", "--kube-context", "kind-dev",
                       capsys=capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("error: cannot read ml-dev/example-deepspeed-training-progress: ConfigException:"), err
    code, out, _ = run("logs", "--env", "dev", "--project", "example", "--rank", "1", "--follow", "--dry-run",
                       capsys=capsys)
    assert code == 0 and out.startswith("+ rank 1: the launcher's log (pdsh relays every rank there), in ml-dev, "
                                        "followed"), out
    # WATCH=1: the same look, followed (kubectl's own words for it), and the same one line without a cluster.
    code, out, _ = run("status", "--env", "dev", "--project", "example", "--dry-run", "--watch", capsys=capsys)
    assert code == 0 and "get configmap example-deepspeed-training-progress --watch -o" in out, out
    code, _, err = run("status", "--env", "dev", "--project", "example", "--kube-context", "kind-dev", "--watch",
                       capsys=capsys)
    assert code == 1 and err.startswith("error: cannot read ml-dev/example-deepspeed-training-progress:"), err


def test_plan_says_where_checkpoints_live_and_what_the_peer_copy_costs(tree, capsys):
    """The chart decides whether the peer copy is on (its env on the workers); the plan reads it from the render and
    prices it from the model's estimate: about one part per worker."""
    code, out, err = run("plan", "--env", "dev", "--project", "example", capsys=capsys)
    assert code == 0, err
    assert "checkpoints per-worker volumes (an emptyDir per worker pod); peer copy on: each worker's volume also " \
        "keeps its neighbour's newest part (~1 MiB per worker" in out, out
    set_key("dev.yaml", "chart", "checkpoints", "peerCopy", False)(tree)
    code, out, err = run("plan", "--env", "dev", "--project", "example", capsys=capsys)
    assert code == 0, err
    assert "peer copy off (checkpoints.peerCopy: false): a lost pod's part of every checkpoint is lost with it" in out
    set_key("dev.yaml", "chart", "checkpoints", "existingClaim", "checkpoints-dev")(tree)
    code, out, err = run("plan", "--env", "dev", "--project", "example", capsys=capsys)
    assert code == 0, err
    assert "checkpoints the shared claim checkpoints-dev" in out and "peer copy" not in out


def test_plan_adds_each_pods_requests_as_the_scheduler_does_and_says_why_it_did_not_ask_a_cluster(tree, capsys,
                                                                                                  monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tree / "no-such-kubeconfig"))
    code, out, err = run("plan", "--env", "dev", "--project", "example", capsys=capsys)
    assert code == 0, err
    # values/dev.yaml asks 1 CPU per worker; the chart's own containers add theirs (the progress sidecar's 10m).
    assert "  requests    2 worker pods x 1.01 CPU, 2.1 GiB memory; 1 launcher pod x " in out, out
    assert "the job 2.03 CPU" in out, out
    assert "  fits        not checked: no cluster reached (ConfigException" in out, out


def test_a_pods_requests_add_sidecars_and_reserve_the_largest_init_container_beside_those_before_it():
    from scripts.deployctl import fit

    def c(cpu, memory="0", **extra):
        return {"resources": {"requests": {"cpu": cpu, "memory": memory}}, **extra}

    spec = {"containers": [c("1", "1Gi"), c("250m")],
            "initContainers": [c("3"), c("100m", "512Mi", restartPolicy="Always"), c("2", "2Gi")]}
    # containers 1.25 CPU + sidecar 0.1 = 1.35; init: 3, then 2 + the sidecar started before it = 2.1: 3 CPU.
    # memory: 1 GiB + 512 MiB = 1.5 GiB; the last init container 2 GiB + the sidecar's 512 MiB = 2.5 GiB.
    assert {k: float(v) for k, v in fit.pod_requests(spec).items()} == {"cpu": 3.0, "memory": 2.5 * 1024 ** 3}
    assert fit.pod_requests({"containers": [{"resources": {"limits": {"cpu": "2"}}}], "overhead": {"cpu": "250m"}}) \
        == {"cpu": fit.Decimal("2.25")}  # a limit alone is the request; the RuntimeClass overhead on top


def test_the_job_fits_only_where_every_pod_finds_a_node_it_may_use():
    from scripts.deployctl.fit import Decimal, Node, PodGroup, fits

    worker = PodGroup("worker", 2, {"cpu": Decimal("1.5"), "nvidia.com/gpu": Decimal(1)},
                      {"pool": "gpu"}, [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}])
    launcher = PodGroup("launcher", 1, {"cpu": Decimal("0.5")})

    def node(name, cpu, gpus=0, pool="gpu", taint=True):
        return Node(name, {"cpu": Decimal(cpu), "nvidia.com/gpu": Decimal(gpus)}, {"pool": pool},
                    [{"key": "gpu", "value": "", "effect": "NoSchedule"}] if taint else [])

    assert fits([worker, launcher], [node("a", 4, 2), node("b", 1, taint=False)]) is None
    assert "worker pod 2 of 2" in fits([worker], [node("a", 2, 2)])  # one worker's CPU left, not two
    assert "worker pod 1 of 2" in fits([worker], [node("a", 4, 2, pool="cpu")])  # the selector names another pool
    assert "launcher pod 1 of 1" in fits([launcher], [node("a", 4, 2)])  # the taint the launcher does not tolerate
