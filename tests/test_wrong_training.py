"""Configs that passed every check and then failed every rank, or trained something other than they said: each is
refused where its rule's owner lives (the chart for the program's shape, mounts and runner flags; train/dsconfig.py
for the ds_config, which the glue and every rank call), naming the key."""

import pytest

from tests.support.chart import HELM, HelmError, render_chart
from tests.support.glue_tree import run, set_key
from tests.support.train_run import cpu_ds_config, run_single, write_ds_config
from train import dsconfig
from train.layout import Layout

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")

CHART = {
    "huggingface convention with the train package": (
        {"train": {"argsConvention": "huggingface"}}, "train.argsConvention \"huggingface\": the train package"),
    "deepspeed convention with the train package": (
        {"train": {"argsConvention": "deepspeed"}}, "train.argsConvention \"deepspeed\": the train package"),
    "fillsDsConfigAuto for the train package": ({"train": {"fillsDsConfigAuto": True}}, "train.fillsDsConfigAuto"),
    "a script on a data volume that is not mounted": (
        {"train": {"script": "/data/code/train.py", "argsConvention": "none"}}, "train.script \"/data/code/train.py\""),
    "{data_dir} with no data volume": (
        {"train": {"args": ["--corpus={data_dir}/c"]}}, "train.args[0] \"--corpus={data_dir}/c\" names {data_dir}"),
    "a token file on a data volume that is not mounted": (
        {"train": {"config": {"data": {"path": "/data/tokens.bin"}}}}, "train.config.data.path \"/data/tokens.bin\""),
    "--bind_core_list without --bind_cores_to_rank": (
        {"deepspeed": {"runnerArgs": ["--bind_core_list=0-3"]}}, "takes effect only with --bind_cores_to_rank"),
    **{f"envFrom prefix {prefix!r}": ({"worker": {"extraEnvFrom": [{"prefix": prefix, "configMapRef": {
        "name": "x"}}]}}, "worker.extraEnvFrom[0].prefix") for prefix in ("", "BASH_", "DS_", "MASTER_", "PA")},
}


@pytest.mark.parametrize("case", CHART, ids=CHART.keys())
def test_the_chart_refuses_what_every_rank_would_fail_on(case):
    values, message = CHART[case]
    with pytest.raises(HelmError) as err:
        render_chart(values)
    assert message in err.value.stderr


def test_what_those_rules_allow_still_renders():
    render_chart({"data": {"existingClaim": "corpus"}, "checkpoints": {"existingClaim": "c"}, "train": {
        "script": "/data/code/train.py", "argsConvention": "none", "args": ["--corpus={data_dir}/c"]}})
    render_chart({"deepspeed": {"runnerArgs": ["--bind_cores_to_rank", "--bind_core_list=0-3"]},
                  "worker": {"extraEnvFrom": [{"prefix": "APP_", "secretRef": {"name": "x"}}]}})


OK = cpu_ds_config(stage=2, micro=4)
DS = {
    "lr above optimizer.params": ({**OK, "optimizer": {**OK["optimizer"], "lr": 1e-4}},
                                  "optimizer.lr: DeepSpeed reads only"),
    "warmup above scheduler.params": ({**OK, "scheduler": {"type": "WarmupLR", "warmup_num_steps": 10, "params": {}}},
                                      "scheduler.warmup_num_steps"),
    "bf16 and bfloat16": ({**OK, "bf16": {"enabled": False}, "bfloat16": {"enabled": False}}, "bf16 and bfloat16"),
    "offload_param with ZeRO 2": ({**OK, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
                                  "zero_optimization.offload_param"),
    **{f"warmup longer than {name}": ({**OK, "scheduler": {"type": name, "params": {
        "total_num_steps": 10, "warmup_num_steps": 20}}}, "warmup_num_steps 20 is longer than total_num_steps 10")
       for name in ("WarmupDecayLR", "WarmupCosineLR")},
    # DeepSpeed reads bf16/fp16's switch as Python truth: the string "false" turns the section on
    **{f"{section} switched by the string {value!r}": ({**OK, section: {"enabled": value}},
                                                       f"{section}.enabled is {value!r}; expected true or false")
       for section, value in (("bf16", "false"), ("fp16", "no"), ("bf16", 0))},
    "a nested switch as a string": ({**OK, "flops_profiler": {"enabled": "true"}}, "flops_profiler.enabled"),
}


@pytest.mark.parametrize("case", DS, ids=DS.keys())
def test_ds_config_settings_deepspeed_would_ignore_are_refused(case):
    config, message = DS[case]
    with pytest.raises(dsconfig.DsConfigError, match="ds_config x.json: .*" + message.replace("(", r"\(")):
        dsconfig.validate(config, Layout(2), "x.json")


def test_the_offload_of_parameters_with_zero_3_is_accepted():
    dsconfig.validate({**OK, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, Layout(2), "x")


def test_steps_in_train_args_set_the_schedules_length_through_the_glue(tree, capsys):
    set_key("dev.yaml", "chart", "train", "args", ["--steps=30"])(tree)
    code, out, err = run("render", "--env", "dev", capsys=capsys)
    assert code == 0, err
    rendered = (tree / "build" / "base" / "dev" / "ds_config.json").read_text()
    assert '"total_num_steps": 30' in rendered


def test_a_warmup_longer_than_the_run_stops_in_the_glue_naming_the_layer(tree, capsys):
    set_key("dev.yaml", "deepspeed", "overrides", "scheduler", "params", "warmup_num_steps", 10 ** 6)(tree)
    code, out, err = run("plan", "--env", "dev", capsys=capsys)
    assert code == 1 and "deepspeed.overrides from values/dev.yaml" in err, err
    assert "warmup_num_steps 1000000 is longer than" in err, err


@pytest.mark.parametrize("config", [{"train_micro_batch_size_per_gpu": 7}, None, {}])
def test_a_ds_config_where_the_glue_writes_its_own_stops_naming_the_layer(tree, capsys, config):
    set_key("dev.yaml", "chart", "deepspeed", "config", config)(tree)
    code, out, err = run("plan", "--env", "dev", capsys=capsys)
    assert code == 1 and err.startswith("error: values/dev.yaml: chart.deepspeed.config: the glue writes"), err
    assert "deepspeed.overrides" in err, err


def test_an_unknown_train_argument_stops_in_the_glue_not_on_every_rank(tree, capsys):
    set_key("dev.yaml", "chart", "train", "args", ["--stepz=30"])(tree)
    code, out, err = run("plan", "--env", "dev", capsys=capsys)
    assert code == 1 and "values/dev.yaml" in err and "unrecognized arguments: --stepz=30" in err, err


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR"])
def test_a_warmup_longer_than_the_run_is_refused_for_any_scheduler(scheduler):
    params = {"warmup_num_steps": 50} | ({"total_num_steps": 30} if scheduler == "WarmupDecayLR" else {})
    config = {**OK, "scheduler": {"type": scheduler, "params": params}}
    with pytest.raises(dsconfig.DsConfigError, match="warmup_num_steps 50 is longer than"):
        dsconfig.validate(config, Layout(2), "x.json")
        dsconfig.check_schedule_length(config, 30, "x.json")
    dsconfig.check_schedule_length({**OK, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 30}}},
                                   30, "x.json")


def test_a_rank_refuses_a_schedule_of_another_length_than_its_run(tmp_path):
    config = {**OK, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 40, "warmup_num_steps": 2}}}
    proc = run_single(["--ds-config", str(write_ds_config(tmp_path, config)), "--steps", "10"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "scheduler.params.total_num_steps 40, but the run trains 10 steps" in proc.stdout


@pytest.mark.parametrize("key_path, value, expected", [
    (("dev.yaml", "deepspeed", "microBatch"), 4.0,
     "values/dev.yaml: deepspeed.microBatch: 4.0 is not of type 'integer'"),
    (("dev.yaml", "chart", "worker", "replicas"), 2.0, "values/dev.yaml: chart.worker.replicas: 2.0 is not of type"),
])
def test_a_float_for_an_integer_is_refused_at_the_users_key_not_a_derived_one(tree, capsys, key_path, value, expected):
    set_key(*key_path, value)(tree)
    code, out, err = run("plan", "--env", "dev", capsys=capsys)
    assert code == 1 and expected in err, err


def test_nan_in_a_ds_config_file_names_the_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {"lr": NaN}}}')
    with pytest.raises(dsconfig.DsConfigError, match=f"ds_config {path}: optimizer.params.lr is nan"):
        dsconfig.load(path)
