"""Real-world ds_configs that must be ACCEPTED: by train/dsconfig.py (the glue's and every rank's check) and by
the chart (`helm template`), with "auto" only where the program fills it. Where cheap, a few run 3 steps."""

import json

import pytest

from tests.support.chart import HELM, render_chart
from tests.support.train_run import run_single
from train import dsconfig
from train.layout import Layout

ADAMW = {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
TORCH_ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}}
HF_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
HF_SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}}
HF_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto"}

# name: (ds_config, world size, the program fills "auto")
LEGIT = {
    "HF Trainer ZeRO-2, all auto": ({**HF_BATCH, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                                     "optimizer": HF_OPTIMIZER, "scheduler": HF_SCHEDULER,
                                     "zero_optimization": {"stage": 2, "allgather_partitions": True,
                                                           "allgather_bucket_size": 2e8, "overlap_comm": True,
                                                           "reduce_scatter": True, "reduce_bucket_size": "auto",
                                                           "contiguous_gradients": True}}, 16, True),
    "HF Trainer ZeRO-3 with auto buckets": ({**HF_BATCH, "bf16": {"enabled": "auto"}, "optimizer": HF_OPTIMIZER,
                                             "scheduler": {"type": "WarmupLR", "params": {
                                                 "warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
                                             "zero_optimization": {
                                                 "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                                 "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                                 "stage3_prefetch_bucket_size": "auto",
                                                 "stage3_param_persistence_threshold": "auto",
                                                 "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                                 "stage3_gather_16bit_weights_on_model_save": True},
                                             "steps_per_print": 2000, "wall_clock_breakdown": False}, 8, True),
    "HF ZeRO-3 CPU offload, auto": ({**HF_BATCH, "optimizer": HF_OPTIMIZER, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}}}, 4, True),
    "Accelerate: batch sizes auto, rest given": ({"train_micro_batch_size_per_gpu": "auto",
                                                  "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                                                  "zero_optimization": {"stage": 2}}, 2, True),
    "auto micro with a given global batch": ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto",
                                              "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}},
                                             8, True),
    "ZeRO-3 NVMe offload with a path": ({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                         "optimizer": ADAMW, "zero_optimization": {
                                             "stage": 3, "offload_optimizer": {"device": "nvme",
                                                                               "nvme_path": "/local_nvme",
                                                                               "pin_memory": True},
                                             "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                                                               "buffer_count": 5, "buffer_size": 1e8}},
                                         "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                                                 "overlap_events": True}}, 8, False),
    "ZeRO-3 with 16-bit weight gathering": ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                             "optimizer": ADAMW, "zero_optimization": {
                                                 "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
                                            16, False),
    "ZeRO-2 CPU offload (DeepSpeedCPUAdam params)": ({"train_micro_batch_size_per_gpu": 4, "optimizer": {
        "type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                   "adam_w_mode": True, "bias_correction": True}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 2, False),
    "monitors: csv": ({"train_micro_batch_size_per_gpu": 2, "csv_monitor": {"enabled": True, "output_path": "/ck/m",
                                                                             "job_name": "run"}}, 2, False),
    "flops profiler": ({"train_micro_batch_size_per_gpu": 2, "flops_profiler": {
        "enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True}}, 2, False),
    "activation checkpointing": ({"train_micro_batch_size_per_gpu": 2, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": 4, "synchronize_checkpoint_boundary": False, "profile": False}}, 2, False),
    "train_batch_size only": ({"train_batch_size": 32, "zero_optimization": {"stage": 2}}, 4, False),
    "micro and accumulation only": ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}, 64,
                                    False),
    "all three batch keys agreeing": ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4,
                                       "gradient_accumulation_steps": 4}, 16, False),
    "fp16 with dynamic loss scale": ({"train_micro_batch_size_per_gpu": 8, "fp16": {
        "enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
        "min_loss_scale": 1}, "optimizer": ADAMW}, 8, False),
    "bf16 with fp32 gradient accumulation": ({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                                              "data_types": {"grad_accum_dtype": "fp32"},
                                              "communication_data_type": "fp32"}, 8, False),
    "OneCycle schedule": ({"train_micro_batch_size_per_gpu": 4, "optimizer": ADAMW, "scheduler": {
        "type": "OneCycle", "params": {"cycle_first_step_size": 1000, "cycle_first_stair_count": 500,
                                       "cycle_second_step_size": 1000, "cycle_second_stair_count": 500,
                                       "decay_step_size": 1000, "cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3,
                                       "decay_lr_rate": 0.001, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99,
                                       "decay_mom_rate": 0.0}}}, 2, False),
    "WarmupDecayLR": ({"train_micro_batch_size_per_gpu": 4, "optimizer": ADAMW, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": 10000, "warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                            "warmup_num_steps": 500, "warmup_type": "linear"}}}, 2, False),
    "WarmupCosineLR": ({"train_micro_batch_size_per_gpu": 4, "optimizer": ADAMW, "scheduler": {
        "type": "WarmupCosineLR", "params": {"total_num_steps": 10000, "warmup_num_steps": 100,
                                             "cos_min_ratio": 0.1}}}, 2, False),
    "a torch scheduler": ({"train_micro_batch_size_per_gpu": 4, "optimizer": TORCH_ADAMW, "scheduler": {
        "type": "StepLR", "params": {"step_size": 100, "gamma": 0.5}}}, 2, False),
    "torch SGD with ZeRO, opted in": ({"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True,
                                      "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                                              "nesterov": True}},
                                      "zero_optimization": {"stage": 1}}, 2, False),
    "torch AdamW (torch_adam)": ({"train_micro_batch_size_per_gpu": 4, "optimizer": {
        "type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True, "foreach": False}},
        "zero_optimization": {"stage": 2}}, 2, False),
    "Adagrad with ZeRO-1": ({"train_micro_batch_size_per_gpu": 4, "optimizer": {
        "type": "Adagrad", "params": {"lr": 0.01, "eps": 1e-10}}, "zero_optimization": {"stage": 1}}, 2, False),
    "Lion": ({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Lion", "params": {
        "lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.01}}, "zero_optimization": {"stage": 2}}, 2, False),
    "Lamb with fp16": ({"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True, "loss_scale": 0},
                        "zero_allow_untested_optimizer": True,
                        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 10.0, "min_coeff": 0.01}},
                        "zero_optimization": {"stage": 1}}, 4, False),
    "no optimizer (the program brings its own)": ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 0}}, 2, False),
    "gradient tuning knobs": ({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                               "prescale_gradients": False, "gradient_predivide_factor": 1.0,
                               "steps_per_print": 10, "wall_clock_breakdown": True, "memory_breakdown": False},
                              2, False),
    "checkpoint section": ({"train_micro_batch_size_per_gpu": 4, "checkpoint": {"tag_validation": "Warn",
                                                                                "use_node_local_storage": False}},
                           2, False),
    "ZeRO-2 GPU tuning as the presets write it": ({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                                                   "optimizer": ADAMW, "zero_optimization": {
                                                       "stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                                       "reduce_scatter": True, "reduce_bucket_size": 500000000,
                                                       "allgather_bucket_size": 500000000,
                                                       "round_robin_gradients": True}}, 64, False),
}


@pytest.mark.parametrize("name", LEGIT, ids=LEGIT.keys())
def test_real_world_configs_pass_the_python_checks(name):
    config, world_size, fills_auto = LEGIT[name]
    micro, accum, total = dsconfig.validate(config, Layout(world_size), name, fills_auto=fills_auto)
    if None not in (micro, accum, total):
        assert micro * accum * world_size == total


@pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")
@pytest.mark.parametrize("name", LEGIT, ids=LEGIT.keys())
def test_real_world_configs_render_through_the_chart(name):
    config, world_size, fills_auto = LEGIT[name]
    gpus = 8 if world_size % 8 == 0 else world_size
    values = {"worker": {"replicas": world_size // gpus, "gpusPerWorker": gpus}, "checkpoints": {"existingClaim": "c"},
              "deepspeed": {"config": config}, "train": {"fillsDsConfigAuto": fills_auto}}
    if fills_auto:  # a program that fills "auto": a Trainer script
        values["train"].update(script="/opt/deepspeed-examples/hf_trainer.py", argsConvention="huggingface")
    docs = render_chart(values, show_only=["configmap.yaml"])
    assert json.loads(docs[0]["data"]["ds_config.json"]) == json.loads(json.dumps(config))


TINY = ["--model.n-layer", "1", "--model.d-model", "32", "--model.n-head", "2", "--model.seq-len", "16"]
RUNS = {"train_batch_size only": {"train_batch_size": 4},
        "micro and accumulation only": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
        "ZeRO-3 with 16-bit weight gathering": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
            "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
        "flops profiler and activation checkpointing": {
            "train_micro_batch_size_per_gpu": 2, "flops_profiler": {"enabled": True, "profile_step": 2},
            "activation_checkpointing": {"partition_activations": False}, "wall_clock_breakdown": True,
            "steps_per_print": 1}}


@pytest.mark.parametrize("name", RUNS, ids=RUNS.keys())
def test_accepted_configs_run_three_steps(tmp_path, name):
    config = {**RUNS[name], "optimizer": TORCH_ADAMW}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    result = run_single([*TINY, "--ds-config", str(path), "--steps", "3", "--log-every", "1",
                         "--checkpoint-dir", str(tmp_path / "ck")])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "step 3/3" in output
