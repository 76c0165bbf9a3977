"""The train package across layouts, with the real DeepSpeed engine on CPU ranks: resuming on another world size
through DeepSpeed's universal checkpoint (ZeRO 1-3), what a changed ds_config does on resume, and pipeline
parallelism (model.pipeline_stages).

Loss tolerance: 2e-3 per step. The data order is global (train/data.py), so a resumed run at another world size
sees the same samples per step; what differs is the order of floating-point reductions (~1e-6 here), and the
progress line prints 4 decimals.
"""

import re
import shutil
from pathlib import Path

import pytest

from tests.support.train_run import cpu_ds_config, run_single, run_train, write_ds_config
from train import checkpoint, dsconfig

TOLERANCE = 2e-3
TINY = ["--model.n-layer=2", "--model.d-model=64", "--model.seq-len=32", "--log-every=1"]
LOSS = re.compile(r"\[rank 0\] INFO step (\d+)/\d+ \| loss ([\d.]+)")


def losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in LOSS.findall(out)}


def train(tmp: Path, ckpt: Path, ranks: int, steps: int, ds: dict, *extra: str):
    result = run_train([f"--ds-config={write_ds_config(tmp, ds, f'ds-{ranks}-{steps}.json')}",
                        f"--checkpoint-dir={ckpt}", f"--steps={steps}", "--checkpoint-every=6", *TINY, *extra],
                       ranks=ranks, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def rewind(ckpt: Path, to: Path, step: int) -> Path:
    """A copy of the checkpoint dir as it was after `step` (newer tags dropped)."""
    shutil.copytree(ckpt, to)
    for tag in checkpoint.tags_newest_first(to):
        if int(tag.name.removeprefix("step_")) > step:
            shutil.rmtree(tag)
    return to


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """reference_runs(stage): 12 steps on 2 ranks, checkpoints at 6 and 12, global batch 12 (micro 2), trained
    once per ZeRO stage for every test of the module (tests copy its checkpoint dir, never change it)."""
    runs = {}

    def run(stage: int):
        if stage not in runs:
            tmp = tmp_path_factory.mktemp(f"zero{stage}")
            ds = cpu_ds_config(stage=stage, micro=2, accum=None, train_batch_size=12)
            runs[stage] = stage, tmp, ds, losses(train(tmp, tmp / "ckpt", 2, 12, ds))
        return runs[stage]
    return run


@pytest.fixture(params=[1, 2, 3], ids=lambda s: f"zero{s}")
def two_rank_run(request, reference_runs):
    return reference_runs(request.param)


@pytest.mark.parametrize("to_ranks", [1, 3])
def test_a_checkpoint_resumes_on_another_world_size_through_a_universal_copy(two_rank_run, to_ranks):
    stage, tmp, ds, reference = two_rank_run
    ckpt = rewind(tmp / "ckpt", tmp / f"to{to_ranks}", 6)
    out = train(tmp, ckpt, to_ranks, 12, ds)
    assert (f"resumed from {ckpt}/step_00000006 at step 6 (written with 2 ranks, ZeRO stage {stage}; universal)"
            in out), out[-3000:]
    assert re.search(rf"converted {ckpt}/step_00000006 to the universal checkpoint {ckpt}/universal/step_00000006 "
                     r"in [\d.]+s", out)
    resumed = losses(out)
    assert sorted(resumed) == list(range(7, 13))
    assert max(abs(resumed[s] - reference[s]) for s in resumed) < TOLERANCE, (resumed, reference)
    assert checkpoint.is_complete(ckpt / "universal" / "step_00000006")
    assert checkpoint.is_complete(ckpt / "step_00000006") and checkpoint.is_complete(ckpt / "step_00000012")
    manifest = checkpoint.read_manifest(ckpt / "step_00000012")  # the new size's own checkpoint
    assert (manifest["world_size"], manifest["zero_stage"]) == (to_ranks, stage)


def test_a_second_resume_at_the_new_size_reuses_the_converted_copy(tmp_path, reference_runs):
    _, tmp, ds, _ = reference_runs(2)
    rewind(tmp / "ckpt", tmp_path / "ckpt", 6)  # as a 2-rank run of 6 steps left it
    source = tmp_path / "ckpt" / "step_00000006"
    files = {p: p.stat().st_mtime_ns for p in source.rglob("*")}
    first = train(tmp_path, tmp_path / "ckpt", 1, 6, ds)  # nothing left to train: converts, loads, stops
    second = train(tmp_path, tmp_path / "ckpt", 1, 6, ds)
    assert "converted" in first and "nothing to do: already at step 6" in first
    assert f"reusing the universal copy {tmp_path}/ckpt/universal/step_00000006" in second
    assert {p: p.stat().st_mtime_ns for p in source.rglob("*")} == files  # the original is never modified


def test_a_platform_can_forbid_resuming_on_another_world_size(tmp_path, reference_runs):
    _, tmp, ds, _ = reference_runs(2)
    rewind(tmp / "ckpt", tmp_path / "ckpt", 6)
    result = run_single([f"--ds-config={write_ds_config(tmp_path, ds)}", f"--checkpoint-dir={tmp_path / 'ckpt'}",
                         "--steps=8", *TINY], DS_RESUME_ACROSS_WORLD_SIZES="false")
    assert result.returncode == 2
    assert ("was written with 2 ranks, ZeRO stage 2; this run has 1 ranks, ZeRO stage 2, and resuming on another "
            "layout is switched off (chart value checkpoints.resumeAcrossWorldSizes)") in result.stdout
    assert not (tmp_path / "ckpt" / "universal").exists()


def test_a_changed_ds_config_says_what_takes_effect_and_refuses_a_new_optimizer(tmp_path):
    ds = cpu_ds_config(stage=1, micro=4)
    ckpt = tmp_path / "ckpt"
    run = [f"--checkpoint-dir={ckpt}", *TINY]
    assert run_single([f"--ds-config={write_ds_config(tmp_path, ds)}", "--steps=6", "--checkpoint-every=6",
                       *run]).returncode == 0
    lr = {**ds, "optimizer": {**ds["optimizer"], "params": {**ds["optimizer"]["params"], "lr": 1e-3}},
          "gradient_clipping": 0.5}
    out = run_single([f"--ds-config={write_ds_config(tmp_path, lr, 'lr.json')}", "--steps=7", *run]).stdout
    assert "ds_config changes since the checkpoint that take effect: gradient_clipping: 1.0 -> 0.5" in out
    assert ("do NOT take effect (the checkpoint's optimizer state wins; set reset_optimizer: true to apply them): "
            "optimizer.params.lr: 0.003 -> 0.001") in out
    assert re.search(r"step 7/7 \| loss [\d.]+ \| lr 3\.000e-03", out)  # as said: the checkpoint's lr
    sgd = {**ds, "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "zero_allow_untested_optimizer": True}
    refused = run_single([f"--ds-config={write_ds_config(tmp_path, sgd, 'sgd.json')}", "--steps=8", *run])
    assert refused.returncode == 2
    assert "optimizer.type changed since the checkpoint (adamw -> sgd)" in refused.stdout
    reset = run_single([f"--ds-config={write_ds_config(tmp_path, sgd, 'sgd.json')}", "--steps=8",
                        "--reset-optimizer=true", *run])
    assert reset.returncode == 0, reset.stdout[-3000:]
    assert "resumed from" in reset.stdout and "optimizer and scheduler reset (reset_optimizer)" in reset.stdout
    assert re.search(r"step 8/8 \| loss [\d.]+ \| lr 1\.000e-02", reset.stdout)


def test_resume_changes_and_cross_layout_rules():
    saved = cpu_ds_config(stage=2)
    assert dsconfig.resume_changes(saved, saved, False, "x") == ([], [])
    assert dsconfig.resume_changes(None, saved, False, "x") == ([], [])
    with pytest.raises(dsconfig.DsConfigError, match=r"precision \(fp16/bf16.enabled\) changed since the checkpoint "
                                                     r"\(fp32 -> bf16\)"):
        dsconfig.resume_changes(saved, {**saved, "bf16": {"enabled": True}}, False, "x")
    assert dsconfig.resume_changes(saved, {**saved, "bf16": {"enabled": True}}, True, "x") == ([], [])
    layout = {"world_size": 1, "zero_stage": 3, "pipeline_stages": 1}
    for saved_layout, message in [
        ({"world_size": 2, "zero_stage": 2, "pipeline_stages": 1}, "not across"),
        ({"world_size": 2, "zero_stage": 3, "pipeline_stages": 2}, "same model.pipeline_stages"),
    ]:
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.cross_layout_load(Path("t"), saved_layout, layout, True, False)
    zero0 = {"world_size": 2, "zero_stage": 0, "pipeline_stages": 1}
    with pytest.raises(checkpoint.CheckpointError, match="needs ZeRO stage 1, 2 or 3"):
        checkpoint.cross_layout_load(Path("t"), zero0, {**zero0, "world_size": 1}, True, False)
    assert checkpoint.cross_layout_load(Path("t"), zero0, {**zero0, "world_size": 1}, True, True) == "weights"


# ---- pipeline parallelism

def pipeline_ds(stage: int = 1, micro: int = 2, accum: int = 4) -> dict:
    return cpu_ds_config(stage=stage, micro=micro, accum=accum)


def test_two_pipeline_stages_train_and_resume_with_the_same_losses(tmp_path):
    ds = pipeline_ds()
    out = train(tmp_path, tmp_path / "ckpt", 2, 12, ds, "--model.pipeline-stages=2")
    assert "x 1 data-parallel rank (2 ranks / 2 pipeline stages) = 8" in out
    assert re.search(r"pipeline stage 0: TokenEmbedding, AddPositions, 2 Block \| [\d.]+M parameters", out) or \
        "pipeline stage 1:" in out
    full = losses(out)
    assert full[12] < full[1]
    ckpt = rewind(tmp_path / "ckpt", tmp_path / "again", 6)
    resumed = losses(train(tmp_path, ckpt, 2, 12, ds, "--model.pipeline-stages=2"))
    assert sorted(resumed) == list(range(7, 13))
    assert max(abs(resumed[s] - full[s]) for s in resumed) < TOLERANCE


def test_two_stages_times_two_data_parallel_ranks_match_plain_data_parallelism(tmp_path):
    ds = pipeline_ds()
    pipeline = losses(train(tmp_path, tmp_path / "pp", 4, 8, ds, "--model.pipeline-stages=2"))
    plain = losses(train(tmp_path, tmp_path / "dp", 2, 8, ds))
    assert max(abs(pipeline[s] - plain[s]) for s in plain) < TOLERANCE, (pipeline, plain)


def test_a_one_stage_pipeline_gives_the_plain_models_losses(tmp_path):
    ds = pipeline_ds(accum=2)
    pipeline = losses(train(tmp_path, tmp_path / "pp", 1, 8, ds, "--model.pipeline-stages=1"))
    plain = losses(train(tmp_path, tmp_path / "plain", 1, 8, ds))
    assert pipeline and max(abs(pipeline[s] - plain[s]) for s in plain) < TOLERANCE


@pytest.mark.parametrize("stages, message", [
    ("3", "model.pipeline_stages 3 must divide the world size 1"),
    ("0", "model.pipeline_stages must be an integer >= 1"),
])
def test_pipeline_stages_that_cannot_split_the_world_stop_before_the_rendezvous(tmp_path, stages, message):
    result = run_single([f"--ds-config={write_ds_config(tmp_path, pipeline_ds())}", "--steps=2", *TINY,
                         f"--model.pipeline-stages={stages}"])
    assert result.returncode == 2 and message in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("ds, message", [
    (pipeline_ds(stage=2), "zero_optimization.stage 2: pipeline parallelism (model.pipeline_stages 2) supports "
                           "ZeRO stage 0 and 1 only"),
    (pipeline_ds(stage=3), "zero_optimization.stage 3: pipeline parallelism"),
    (pipeline_ds(stage=0), "DeepSpeed clips by the gradient norm of the first stage only"),
])
def test_zero_settings_pipeline_mode_cannot_run_are_refused(ds, message):
    with pytest.raises(dsconfig.DsConfigError, match=re.escape(message)):
        dsconfig.check_pipeline(ds, 2, "x")
    dsconfig.check_pipeline(ds, 1, "x")  # no pipeline: no limit
