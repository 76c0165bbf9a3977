"""Hostile and malformed files at the train package's start-up (`python -m train`): every one is refused by
the same checks a rank runs before joining the process group (train.main.check_inputs), with one line naming
the file and the key. A few go through the real `python -m train` to prove the exit status and the output."""

import json

import numpy as np
import pytest

from tests.support.payloads import ALIAS_BOMB
from tests.support.train_run import cpu_ds_config, run_single
from train import checkpoint, dsconfig
from train.checks import check_inputs
from train.config import ConfigError, parse_args
from train.data import DataError

REFUSED = (ConfigError, dsconfig.DsConfigError, DataError, checkpoint.CheckpointError)
TINY = ["--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.seq-len", "16"]


def ds(tmp, config=None, *, text=None, data=None, name="ds.json"):
    path = tmp / name
    if data is not None:
        path.write_bytes(data)
    else:
        path.write_text(text if text is not None else json.dumps(config))
    return ["--ds-config", str(path)]


def cfg_file(tmp, text=None, data=None):
    path = tmp / "train.yaml"
    path.write_bytes(data) if data is not None else path.write_text(text)
    return ["--config", str(path)]


def tokens(tmp, data: bytes):
    path = tmp / "tokens.bin"
    path.write_bytes(data)
    return ["--data.path", str(path)]


def with_(**extra):
    return cpu_ds_config(**extra)


OK = cpu_ds_config()

# (arguments built in a temp dir, substrings of the error: the file and the key)
BAD = {
    # unreadable ds_config files
    "binary ds_config": (lambda t: ds(t, data=b"\x00\xff\xfe\x01"), ["ds.json", "not UTF-8"]),
    "latin-1 ds_config": (lambda t: ds(t, data='{"a": "caf\xe9"}'.encode("latin-1")), ["ds.json", "not UTF-8"]),
    "empty ds_config": (lambda t: ds(t, text=""), ["ds.json", "not valid JSON"]),
    "ds_config is a list": (lambda t: ds(t, text="[1, 2]"), ["ds.json", "JSON object"]),
    "ds_config is a directory": (lambda t: ["--ds-config", str(t)], ["ds_config", "cannot read"]),
    "duplicate top-level key": (lambda t: ds(t, text='{"train_micro_batch_size_per_gpu": 1, '
                                                     '"train_micro_batch_size_per_gpu": 2}'),
                                ["ds.json", "'train_micro_batch_size_per_gpu' appears twice"]),
    "duplicate nested key": (lambda t: ds(t, text='{"train_micro_batch_size_per_gpu": 1, "zero_optimization": '
                                                  '{"stage": 1, "stage": 3}}'), ["ds.json", "'stage' appears twice"]),
    "NaN": (lambda t: ds(t, text='{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": NaN}'),
            ["ds.json", "gradient_clipping is nan"]),
    "Infinity": (lambda t: ds(t, text='{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": Infinity}'),
                 ["ds.json", "gradient_clipping is inf"]),
    "-Infinity": (lambda t: ds(t, text='{"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", '
                                       '"params": {"lr": -Infinity}}}'), ["ds.json", "optimizer.params.lr is -inf"]),
    "ds_config is a device": (lambda t: ["--ds-config", "/dev/zero"], ["/dev/zero", "not a regular file"]),
    "huge ds_config": (lambda t: ds(t, text='{"a": "' + "x" * 5_000_000 + '"}'), ["ds.json", "bytes"]),
    "nested too deeply": (lambda t: ds(t, text='{"a": ' + "[" * 100000 + "]" * 100000 + "}"), ["ds.json"]),
    # what DeepSpeed would ignore, drop or crash on
    "unknown top-level key": (lambda t: ds(t, with_(trian_batch_size=8)), ["ds.json", "'trian_batch_size'"]),
    "auto in a program that does not fill it": (lambda t: ds(t, with_(gradient_clipping="auto")),
                                                ["ds.json", "gradient_clipping", '"auto"']),
    "auto batch": (lambda t: ds(t, {**OK, "train_micro_batch_size_per_gpu": "auto"}),
                   ["ds.json", "train_micro_batch_size_per_gpu"]),
    "micro batch as a string": (lambda t: ds(t, {**OK, "train_micro_batch_size_per_gpu": "4"}),
                                ["ds.json", "train_micro_batch_size_per_gpu must be an integer"]),
    "batch against the world size": (lambda t: ds(t, with_(train_batch_size=12)), ["ds.json", "train_batch_size 12"]),
    "section that is not an object": (lambda t: ds(t, {**OK, "optimizer": "adamw"}),
                                      ["ds.json", "optimizer must be an object"]),
    "optimizer typo": (lambda t: ds(t, with_(optimizer={"type": "Adamw_torch", "params": {}})),
                       ["ds.json", "optimizer.type 'Adamw_torch'"]),
    "optimizer in the wrong case": (lambda t: ds(t, with_(optimizer={"type": "sgd", "params": {"lr": 0.1}})),
                                    ["ds.json", "optimizer.type 'sgd'", "'SGD'"]),
    "optimizer param unknown": (lambda t: ds(t, with_(optimizer={"type": "AdamW", "params": {
        "lr": 1e-3, "torch_adam": True, "beta1": 0.9}})), ["ds.json", "optimizer.params.beta1"]),
    "optimizer lr as a string": (lambda t: ds(t, with_(optimizer={"type": "AdamW", "params": {
        "lr": "1e-3", "torch_adam": True}})), ["ds.json", "optimizer.params.lr must be a number"]),
    "betas of three": (lambda t: ds(t, with_(optimizer={"type": "AdamW", "params": {
        "betas": [0.9, 0.95, 0.99], "torch_adam": True}})), ["ds.json", "optimizer.params.betas"]),
    "torch_adam as a string": (lambda t: ds(t, with_(optimizer={"type": "AdamW", "params": {"torch_adam": "yes"}})),
                               ["ds.json", "optimizer.params.torch_adam"]),
    "max_grad_norm": (lambda t: ds(t, with_(optimizer={"type": "AdamW", "params": {"max_grad_norm": 1.0,
                                                                                   "torch_adam": True}})),
                      ["ds.json", "max_grad_norm", "gradient_clipping"]),
    "untested optimizer with ZeRO": (lambda t: ds(t, with_(optimizer={"type": "SGD", "params": {"lr": 0.1}})),
                                     ["ds.json", "zero_allow_untested_optimizer"]),
    "amsgrad in a fused Adam": (lambda t: ds(t, with_(optimizer={"type": "Adam", "params": {"amsgrad": True}})),
                                ["ds.json", "amsgrad"]),
    "mup optimizer without mup": (lambda t: ds(t, with_(optimizer={"type": "MuAdam", "params": {}})),
                                  ["ds.json", "mup"]),
    "scheduler typo": (lambda t: ds(t, with_(scheduler={"type": "WarmupCosine", "params": {}})),
                       ["ds.json", "scheduler.type 'WarmupCosine'", "'WarmupCosineLR'"]),
    "scheduler without params": (lambda t: ds(t, with_(scheduler={"type": "WarmupLR"})),
                                 ["ds.json", "scheduler.params is missing"]),
    "scheduler missing a required param": (lambda t: ds(t, with_(scheduler={"type": "WarmupDecayLR", "params": {}})),
                                           ["ds.json", "scheduler.params needs total_num_steps"]),
    "scheduler param unknown": (lambda t: ds(t, with_(scheduler={"type": "WarmupLR", "params": {"warmup": 5}})),
                                ["ds.json", "scheduler.params.warmup"]),
    "scheduler param refused by its constructor": (
        lambda t: ds(t, with_(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}})),
        ["ds.json", "warmup_num_steps"]),
    "scheduler steps as a string": (
        lambda t: ds(t, with_(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": "100"}})),
        ["ds.json", "scheduler.params.total_num_steps"]),
    "steps_per_print 0": (lambda t: ds(t, with_(steps_per_print=0)), ["ds.json", "steps_per_print"]),
    "NVMe parameters without a path": (lambda t: ds(t, with_(zero_optimization={"stage": 3, "offload_param": {
        "device": "nvme"}})), ["ds.json", "offload_param.nvme_path"]),
    "wandb not in this image": (lambda t: ds(t, with_(wandb={"enabled": True})), ["ds.json", "wandb.enabled"]),
    "comet not in this image": (lambda t: ds(t, with_(comet={"enabled": True})), ["ds.json", "comet.enabled"]),
    "comms logger, even disabled": (lambda t: ds(t, with_(comms_logger={"enabled": False})),
                                    ["ds.json", "comms_logger"]),
    "ZeRO stage 7": (lambda t: ds(t, with_(zero_optimization={"stage": 7})), ["ds.json", "stage"]),
    "negative learning rate": (lambda t: ds(t, with_(optimizer={"type": "AdamW", "params": {
        "lr": -1e-3, "torch_adam": True}})), ["ds.json", "optimizer AdamW refuses", "learning rate"]),
    "beta out of range in a fused Adam": (lambda t: ds(t, with_(optimizer={"type": "Adam", "params": {
        "betas": [0.9, 1.5]}})), ["ds.json", "optimizer Adam refuses", "beta"]),
    "fp16 and bf16 together": (lambda t: ds(t, with_(fp16={"enabled": True}, bf16={"enabled": True})),
                               ["ds.json", "DeepSpeed rejects it"]),
    # the train config file
    "binary train config": (lambda t: ds(t, OK) + cfg_file(t, data=b"\xff\xfe\x00"), ["train.yaml", "not UTF-8"]),
    "train config with a control character": (lambda t: ds(t, OK) + cfg_file(t, text="steps: 5\x07\n"),
                                              ["train.yaml"]),
    "train config duplicate key": (lambda t: ds(t, OK) + cfg_file(t, text="steps: 5\nsteps: 6\n"),
                                   ["train.yaml:2:1", "duplicate key 'steps'"]),
    "train config alias bomb": (lambda t: ds(t, OK) + cfg_file(t, text=ALIAS_BOMB), ["train.yaml", "expands to more"]),
    "train config key that YAML reads as a boolean": (lambda t: ds(t, OK) + cfg_file(t, text="on: 5\n"),
                                                      ["train.yaml:1:1", "'on'", "quote it"]),
    "train config is a list": (lambda t: ds(t, OK) + cfg_file(t, text="- 1\n"), ["train.yaml", "mapping"]),
    "train config steps as text": (lambda t: ds(t, OK) + cfg_file(t, text="steps: ten\n"), ["train.yaml", "steps"]),
    "train config NaN dropout": (lambda t: ds(t, OK) + cfg_file(t, text="model: {dropout: .nan}\n"),
                                 ["train.yaml", "model.dropout"]),
    "train config model not a map": (lambda t: ds(t, OK) + cfg_file(t, text="model: 4\n"), ["train.yaml", "model"]),
    # token files
    "empty token file": (lambda t: ds(t, OK) + tokens(t, b""), ["tokens.bin", "0 bytes"]),
    "odd-sized token file": (lambda t: ds(t, OK) + tokens(t, b"\x01\x00\x02"), ["tokens.bin", "3 bytes"]),
    "token file is a directory": (lambda t: ds(t, OK) + ["--data.path", str(t)], ["data.path", "no such file"]),
    "token ids past the vocabulary": (lambda t: ds(t, OK) + tokens(t, np.full(4096, 300, "<u2").tobytes()),
                                      ["tokens.bin", "token id 300"]),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_bad_start_up_inputs_are_refused_naming_file_and_key(tmp_path, case):
    make_args, expected = BAD[case]
    with pytest.raises(REFUSED) as err:
        cfg = parse_args([*TINY, *make_args(tmp_path)])
        check_inputs(cfg, rank=0, world_size=1)
    message = str(err.value)
    assert "\n" not in message, message
    for text in expected:
        assert text in message, message


REAL = {"binary ds_config": ["ds.json", "not UTF-8"], "comms logger, even disabled": ["comms_logger"],
        "train config duplicate key": ["duplicate key 'steps'"], "odd-sized token file": ["3 bytes"]}


@pytest.mark.parametrize("case", REAL, ids=REAL.keys())
def test_python_m_train_exits_2_with_one_error_line_and_no_traceback(tmp_path, case):
    make_args, _ = BAD[case]
    result = run_single([*TINY, *make_args(tmp_path), "--steps", "5"])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and all(text in errors[0] for text in REAL[case]), output[-3000:]
    assert "Traceback" not in output


def test_a_rank_refuses_a_world_smaller_than_the_chart_asked_for(tmp_path):
    """A launcher that lost a worker (or GPUs) must not "complete" on fewer ranks (kubeflow/trainer#4028)."""
    result = run_single([*TINY, *ds(tmp_path, OK), "--steps", "3"], DS_WORLD_SIZE="2")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "world size 1 (WORLD_SIZE from DeepSpeed's launcher), but the chart runs 2 ranks (DS_WORLD_SIZE" in output
    assert "step 1/" not in output


def test_a_rank_refuses_to_start_seeing_fewer_gpus_than_its_worker_was_given(tmp_path):
    """worker.gpuResourceName set: a node that gives the pod fewer GPUs (here none: DeepSpeed picks the CPU) must
    not train on the CPU or fail later; one line names both numbers."""
    result = run_single([*TINY, *ds(tmp_path, OK), "--steps", "3"], DS_GPUS_PER_WORKER="2")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "this worker's ranks see 0 GPUs (DeepSpeed's accelerator: cpu), but worker.gpusPerWorker is 2" in output
    assert "step 1/" not in output and "Traceback" not in output


class Hardware:
    """What a rank's accelerator reports of its hardware, given by the test (the check's input, not the check)."""

    def __init__(self, fp16: bool, bf16: bool = True):
        self.fp16, self.bf16 = fp16, bf16

    def device_name(self):
        return "cpu"

    def is_fp16_supported(self):
        return self.fp16

    def is_bf16_supported(self):
        return self.bf16


@pytest.mark.parametrize("fp16", [True, False])
def test_fp16_is_refused_exactly_where_the_ranks_own_cpu_lacks_it(fp16):
    config = {"fp16": {"enabled": True}}
    if fp16:
        dsconfig.check_precision(config, Hardware(fp16=True), "ds.json")
    else:
        with pytest.raises(dsconfig.DsConfigError, match=r"ds.json: fp16.enabled: the cpu accelerator"):
            dsconfig.check_precision(config, Hardware(fp16=False), "ds.json")


def test_a_rank_asks_its_own_cpu_about_fp16(tmp_path):
    """The rank's start-up check answers as this machine's CPU does, on any x86-64 CPU."""
    from deepspeed.accelerator import get_accelerator
    cfg = parse_args([*TINY, *ds(tmp_path, with_(fp16={"enabled": True}))])
    if get_accelerator().is_fp16_supported():
        check_inputs(cfg, rank=0, world_size=1)
    else:
        with pytest.raises(REFUSED, match="fp16.enabled"):
            check_inputs(cfg, rank=0, world_size=1)
