"""The config check (templates/config-check.yaml) as Helm runs it before anything else of an install: the rendered
hook Job's pod on a namespace host, as the pods' user, with its ConfigMap mounted where the ranks read theirs.
So the chart alone, without the glue, refuses what every rank would refuse at start, in one line naming the value;
the cluster tier shows `helm install` failing with that line (tests/cluster/test_cluster.py).

Every case runs the rendered hook's command, env and files through train.preflight in this process (the module
the pod runs; it imports DeepSpeed once here instead of once per pod); a case of each kind also runs as the pod."""

import logging

import pytest

from tests.support.chart import hooks, render_chart
from tests.support.chart_pods import REASON, UID
from tests.support.harness import Cluster, ensure_user, wait

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# A shared claim: the programs of their own here resume from DeepSpeed's `latest`, which one volume must hold.
CPU = {"worker": {"replicas": 2, "gpuResourceName": ""}, "checkpoints": {"existingClaim": "checkpoints"}}
MICRO = {"train_micro_batch_size_per_gpu": 1}
BYO = {"script": "/opt/app/train.py", "argsConvention": "deepspeed"}  # a program of its own: the ds_config only

# name: (values over CPU, what the one line says). Each is a mistake every rank would refuse at start.
REFUSED = {
    "batch against the data-parallel ranks": (
        {"deepspeed": {"config": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                  "gradient_accumulation_steps": 1}}},
        ["deepspeed.config", "train_batch_size 16", "2 data-parallel ranks"]),
    "global batch not a multiple": (
        {"worker": {"replicas": 3}, "deepspeed": {"config": {"train_batch_size": 16,
                                                             "train_micro_batch_size_per_gpu": 4}}},
        ["train_batch_size 16", "3 data-parallel ranks"]),
    "global batch and accumulation": (
        {"worker": {"replicas": 3}, "deepspeed": {"config": {"train_batch_size": 16,
                                                             "gradient_accumulation_steps": 2}}},
        ["train_batch_size 16"]),
    "no batch at all": ({"deepspeed": {"config": {"gradient_clipping": 1.0}}}, ["train_micro_batch_size_per_gpu"]),
    "lr as a string (helm --set)": (
        {"deepspeed": {"config": {**MICRO, "optimizer": {"type": "AdamW", "params": {"lr": "0.0005"}}}}}, ["lr"]),
    "micro batch as a string": ({"deepspeed": {"config": {"train_micro_batch_size_per_gpu": "8"}}},
                                ["train_micro_batch_size_per_gpu"]),
    "zero micro batch": ({"deepspeed": {"config": {"train_micro_batch_size_per_gpu": 0}}},
                         ["train_micro_batch_size_per_gpu"]),
    "auto without a program that fills it": (
        {"train": BYO, "deepspeed": {"config": {"train_micro_batch_size_per_gpu": "auto"}}},
        ["train_micro_batch_size_per_gpu", "train.fillsDsConfigAuto"]),
    "steps_per_print 0": ({"deepspeed": {"config": {**MICRO, "steps_per_print": 0}}}, ["steps_per_print"]),
    "ZeRO stage 4": ({"train": BYO, "deepspeed": {"config": {**MICRO, "zero_optimization": {"stage": 4}}}},
                     ["stage"]),
    "betas of one": ({"deepspeed": {"config": {**MICRO, "optimizer": {"type": "AdamW",
                                                                      "params": {"betas": [0.9]}}}}}, ["betas"]),
    "optimizer without a type": ({"train": BYO, "deepspeed": {"config": {**MICRO, "optimizer": {"params": {}}}}},
                                 ["type"]),
    "bf16 enabled as a string": ({"deepspeed": {"config": {**MICRO, "bf16": {"enabled": "yes"}}}}, ["enabled"]),
    # the train package: its layout, config and arguments, as its ranks parse them
    "pipeline stages that do not divide the world": (
        {"train": {"config": {"model": {"pipeline_stages": 3}}}}, ["pipeline_stages 3", "world size 2"]),
    "pipeline stages on per-worker checkpoint volumes": (
        {"checkpoints": {}, "deepspeed": {"config": {**MICRO, "zero_optimization": {"stage": 1}}},
         "train": {"config": {"model": {"pipeline_stages": 2}}}}, ["model.pipeline_stages 2", "per-worker"]),
    "pipeline stages with ZeRO 2": (
        {"deepspeed": {"config": {**MICRO, "zero_optimization": {"stage": 2}}},
         "train": {"config": {"model": {"pipeline_stages": 2}}}}, ["ZeRO", "stage 2"]),
    "unknown train config key": ({"train": {"config": {"stpes": 10}}}, ["train.config", "stpes"]),
    "warmup longer than the run": (
        {"deepspeed": {"config": {**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 500}}}},
         "train": {"config": {"steps": 100}}}, ["warmup_num_steps 500", "100"]),
    "an argument the program refuses": ({"train": {"args": ["--steps=many"]}}, ["train.args", "--steps"]),
    # DeepSpeed's kernels, for CPU ranks (worker.gpuResourceName ""), with any program
    "a fused optimizer on CPU ranks": (
        {"train": BYO, "deepspeed": {"config": {**MICRO, "optimizer": {"type": "Lamb", "params": {"lr": 0.001}}}}},
        ["optimizer.type Lamb", "no CPU implementation"]),
}


# A refused case of each kind also runs as the pod: a program of its own (the ds_config alone), the train package's
# ds_config, config, arguments and layout, and the CPU ranks' flag.
POD_CASES = ["auto without a program that fills it", "batch against the data-parallel ranks",
             "unknown train config key", "an argument the program refuses",
             "pipeline stages that do not divide the world", "a fused optimizer on CPU ranks"]


def hook_docs(values: dict) -> list[dict]:
    """The check's ConfigMap and Job (its ServiceAccount, which Helm creates before them, holds nothing to run)."""
    docs = hooks(render_chart({**CPU, **values, "worker": {**CPU["worker"], **values.get("worker", {})}}))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "ConfigMap", "Job"]
    return docs[1:]


def run_pod(values: dict) -> tuple[int, str]:
    ensure_user(UID, "/home/deepspeed")
    with Cluster(hook_docs(values), subnet=236) as cluster:
        pod = cluster.pods_of("config-check")[0]
        return wait(cluster.start(pod), timeout=120), pod.log()


def run_here(values: dict, tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    """The hook's rendered command, env and ConfigMap files, run by train.preflight in this process."""
    from train import preflight
    config_map, job = hook_docs(values)
    check = job["spec"]["template"]["spec"]["containers"][0]
    assert check["command"] == ["python3", "-m", "train.preflight"]
    mount = next(m["mountPath"] for m in check["volumeMounts"] if m["name"] == "config")
    for name, text in config_map["data"].items():
        (tmp_path / name).write_text(text)
    here = lambda text: text.replace(mount, str(tmp_path))  # noqa: E731 - where this process reads the files
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as in the pod: no device
    for entry in check["env"]:
        if entry["name"] != "HOME":
            monkeypatch.setenv(entry["name"], here(entry["value"]))
    capsys.readouterr()
    level = logging.getLogger("DeepSpeed").level  # main() quiets DeepSpeed's logger, for this process's later tests
    try:
        code = preflight.main([here(arg) for arg in check.get("args", [])])
    finally:
        logging.getLogger("DeepSpeed").setLevel(level)
    out = capsys.readouterr()
    return code, out.out + out.err


def assert_refused(code: int, log: str, expected: list[str]) -> None:
    assert code == 2, log
    [line] = [line for line in log.splitlines() if line.startswith("config check failed: ")]
    for text in expected:
        assert text in line, log
    assert "Traceback" not in log, log


@pytest.mark.parametrize("case", REFUSED, ids=REFUSED.keys())
def test_the_config_check_refuses_what_every_rank_would_in_one_line_naming_the_value(case, tmp_path, monkeypatch,
                                                                                      capsys):
    values, expected = REFUSED[case]
    assert_refused(*run_here(values, tmp_path, monkeypatch, capsys), expected)


@pytest.mark.parametrize("case", POD_CASES)
def test_the_config_checks_pod_refuses_as_the_pods_user_on_its_own_host(case):
    values, expected = REFUSED[case]
    assert_refused(*run_pod(values), expected)


# Every mode and program here; as the pod, one mode per program.
PASSING = [(mode, program, "here") for mode in ("ssh", "nossh") for program in ("train package", "own program")] \
    + [("ssh", "train package", "pod"), ("nossh", "own program", "pod")]


@pytest.mark.parametrize("mode, program, where", PASSING, ids=[" ".join(p) for p in PASSING])
def test_a_config_every_rank_accepts_passes_the_check_in_both_modes(mode, program, where, tmp_path, monkeypatch,
                                                                    capsys):
    values = {"launchMode": mode, "worker": {"replicas": 2, "gpusPerWorker": 2},
              "deepspeed": {"config": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                       "zero_optimization": {"stage": 1}}}}
    if program == "own program":
        values["train"] = {**BYO, "fillsDsConfigAuto": True}
        values["deepspeed"]["config"]["gradient_clipping"] = "auto"
    code, log = run_pod(values) if where == "pod" else run_here(values, tmp_path, monkeypatch, capsys)
    assert code == 0, log
    assert "config check passed: ds_config for 4 data-parallel ranks (world size 4), batch micro 4 x " \
           "accumulation 2 = 32" in log, log
    assert ("train config and arguments" in log) == (program == "train package"), log
