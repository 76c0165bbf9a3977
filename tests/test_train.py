"""The train package with the real DeepSpeed engine on 2 CPU ranks (gloo)."""

import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from podruntime import protocol
from tests.support.harness import wait_for
from tests.support.train_run import (
    TINY,
    Ranks,
    cpu_ds_config,
    launch,
    launch_argv_env,
    metrics,
    run_single,
    run_train,
    stop_with_stacks,
    write_ds_config,
)
from train import checkpoint


def losses(ckpt_dir) -> dict[int, float]:
    return {step: loss for step, loss in metrics(ckpt_dir)["losses"]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_and_the_loss_falls(tmp_path, stage):
    ds_config = write_ds_config(tmp_path, cpu_ds_config(stage=stage))
    ckpt = tmp_path / "ckpt"
    result = run_train(["--ds-config", str(ds_config), "--steps", "30", "--log-every", "10",
                        "--checkpoint-dir", str(ckpt), *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    assert (f"world size 2 | ZeRO stage {stage} | fp32 | batch 4 micro x 1 accumulation x 2 data-parallel ranks = 8"
            in result.stdout)
    log_lines = re.findall(r"\[rank 0\] INFO step (\d+)/30 \| loss ([\d.]+) \| lr ([\d.e+-]+) \| ([\d,]+) tokens/s "
                           r"\| ([\d.]+) samples/s \| eta (\d+:\d\d:\d\d)", result.stdout)
    assert [int(line[0]) for line in log_lines] == [10, 20, 30]
    assert "[rank 1] INFO" not in result.stdout  # progress on rank 0 only
    run = losses(ckpt)
    assert sorted(run) == list(range(1, 31))
    assert np.mean([run[s] for s in range(26, 31)]) < 0.8 * np.mean([run[s] for s in range(1, 6)])
    summary = metrics(ckpt)
    assert summary["steps"] == 30 and summary["world_size"] == 2 and summary["tokens_per_s"] > 0
    assert checkpoint.is_complete(ckpt / "step_00000030")


def test_gradient_accumulation_and_global_batch_come_from_ds_config(tmp_path):
    ds_config = write_ds_config(tmp_path, cpu_ds_config(micro=2, accum=None, train_batch_size=16))
    result = run_train(["--ds-config", str(ds_config), "--steps", "3", "--log-every", "1", *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    assert "batch 2 micro x 4 accumulation x 2 data-parallel ranks = 16" in result.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Reference: 16 steps in one run (ZeRO-2, grad accumulation 2, checkpoint every 4; 8, 12, 16 are kept)."""
    tmp = tmp_path_factory.mktemp("reference")
    ds_config = write_ds_config(tmp, cpu_ds_config(stage=2, micro=2, accum=2))
    ckpt = tmp / "ckpt"
    result = run_train(["--ds-config", str(ds_config), "--steps", "16", "--checkpoint-every", "4",
                        "--checkpoint-dir", str(ckpt), *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    (tmp / "out.log").write_text(result.stdout)
    return ds_config, ckpt


def test_resume_continues_with_the_same_losses(tmp_path, uninterrupted):
    ds_config, reference = uninterrupted
    ckpt = tmp_path / "ckpt"
    common = ["--ds-config", str(ds_config), "--checkpoint-every", "4", "--checkpoint-dir", str(ckpt), *TINY]
    first = run_train([*common, "--steps", "8"])
    assert first.returncode == 0, first.stdout[-4000:]
    second = run_train([*common, "--steps", "16"])
    assert second.returncode == 0, second.stdout[-4000:]
    assert f"resumed from {ckpt / 'step_00000008'} at step 8" in second.stdout
    assert "to save, but a SIGTERM" not in second.stdout  # no grace known here: nothing to warn about
    assert json.loads((ckpt / "step_00000008" / checkpoint.COMMIT_FILE).read_text())["save_s"] > 0
    resumed, expected = losses(ckpt), losses(reference)
    assert sorted(resumed) == list(range(9, 17))
    for step in range(9, 17):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


def test_incomplete_checkpoints_are_skipped_on_resume(tmp_path, uninterrupted):
    ds_config, reference = uninterrupted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference, ckpt)
    # step 16: killed before the commit; step 12: a shard cut short (e.g. a full disk). Both newer than 8.
    (ckpt / "step_00000016" / checkpoint.COMMIT_FILE).unlink()
    shard = next((ckpt / "step_00000012").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:1000])
    result = run_train(["--ds-config", str(ds_config), "--checkpoint-dir", str(ckpt), "--steps", "10", *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"skipping incomplete checkpoint {ckpt / 'step_00000016'}" in result.stdout
    assert f"skipping incomplete checkpoint {ckpt / 'step_00000012'}" in result.stdout
    assert f"resumed from {ckpt / 'step_00000008'} at step 8" in result.stdout
    assert (ckpt / "latest").read_text() == "step_00000010"
    # Pruning keeps the newest complete ones and drops the broken tags.
    assert sorted(p.name for p in checkpoint.tags_newest_first(ckpt)) == ["step_00000008", "step_00000010"]


def test_a_dir_of_only_incomplete_checkpoints_is_an_error_not_a_fresh_start(tmp_path, uninterrupted):
    ds_config, reference = uninterrupted
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference, ckpt)
    (ckpt / "latest").unlink()  # DeepSpeed alone would silently start from scratch here
    for tag in checkpoint.tags_newest_first(ckpt):
        (tag / checkpoint.COMMIT_FILE).unlink()
    result = run_single(["--ds-config", str(ds_config), "--checkpoint-dir", str(ckpt), "--steps", "20", *TINY])
    assert result.returncode == 2
    assert f"checkpoint dir {ckpt}: none of its 3 checkpoints is complete" in result.stdout
    assert "refusing to start from scratch" in result.stdout


def test_sigterm_saves_a_checkpoint_and_exits_non_zero(tmp_path):
    ds_config = write_ds_config(tmp_path, cpu_ds_config())
    ckpt = tmp_path / "ckpt"
    process = launch(["--ds-config", str(ds_config), "--steps", "100000", "--log-every", "1",
                      "--checkpoint-dir", str(ckpt), *TINY])
    deadline = time.monotonic() + 180
    seen = ""
    while "step 3/" not in seen and time.monotonic() < deadline:
        seen += process.stdout.readline()
    assert "step 3/" in seen, seen[-3000:]
    os.killpg(process.pid, signal.SIGTERM)  # as the kubelet signals every process of the container
    out, _ = process.communicate(timeout=120)
    out = seen + out
    assert process.returncode != 0
    stopped = int(re.search(r"SIGTERM: stopped at step (\d+), checkpoint at step (\d+)", out).group(1))
    assert checkpoint.is_complete(ckpt / checkpoint.tag_for(stopped))
    assert (ckpt / "latest").read_text() == checkpoint.tag_for(stopped)


def test_background_saves_commit_each_tag_once_written_and_say_what_the_steps_waited(uninterrupted):
    _, ckpt = uninterrupted  # saved in the background, the default; the resumes above match it step for step
    out = (ckpt.parent / "out.log").read_text()
    for step in (4, 8, 12):  # the last step's save waits for its write, as a SIGTERM's does (12's first)
        assert re.search(rf"saved checkpoint step_{step:08d} in [\d.]+s in the background \([\d.]+ MB on this rank, "
                         r"[\d,]+ MB/s; the steps waited [\d.]+s\)", out), out[-4000:]
    assert re.search(r"saved checkpoint step_00000016 in [\d.]+s\n", out), out[-4000:]
    assert sorted(p.name for p in checkpoint.tags_newest_first(ckpt)) == [
        "step_00000008", "step_00000012", "step_00000016"]
    assert all(checkpoint.is_complete(tag) for tag in checkpoint.tags_newest_first(ckpt))
    assert (ckpt / "latest").read_text() == "step_00000016"


def test_one_attempts_goodput_leaves_none_of_its_wall_time_unaccounted(uninterrupted):
    """A step's time runs from the end of the step or save before it: the step loop's work between steps (its
    report, a background save's poll) is the steps' time, as on a stopwatch, not time nothing measured."""
    _, ckpt = uninterrupted
    split = metrics(ckpt)["goodput_s"]
    assert split["attempts"] == 1 and split["save"] > 0 and split["productive"] > 0, split
    assert abs(split["unaccounted"]) < 0.01, split  # the six buckets are rounded to milliseconds


@pytest.fixture
def small_volume(tmp_path):
    """A checkpoint volume of `size` bytes (a tmpfs: root), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = []

    def mount(size: int):
        path = tmp_path / "volume"
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_checkpoint_volume_stops_every_rank_in_one_line_and_the_last_committed_tag_stays(
        tmp_path, uninterrupted, small_volume):
    ds_config, reference = uninterrupted
    tag_bytes = sum(p.stat().st_size for p in (reference / "step_00000008").rglob("*") if p.is_file())
    ckpt = small_volume(tag_bytes * 3 // 2)  # room for one tag, not for the next beside it
    state = tmp_path / "state"
    result = run_train(["--ds-config", str(ds_config), "--steps", "100", "--checkpoint-every", "2",
                        "--checkpoint-dir", str(ckpt), *TINY],
                       env_extra={protocol.STATE_DIR_ENV: str(state), "DS_RUN_ID": "run-0001-test"})
    assert result.returncode == 2, result.stdout[-4000:]
    # Every rank that hit it says so to the ledger: storage-error, not a configuration error.
    ends = [json.loads(p.read_text()) for p in state.glob("end-*.json")]
    assert ends and {e["cause"] for e in ends} == {"storage-error"} and all("step_00000004" in e["line"] for e in ends)
    # torch.save's zip writer reports the full disk as a RuntimeError: the volume's room says what it was.
    assert re.search(rf"ERROR checkpoint {ckpt}/step_00000004: writing it failed \(.+\) on the checkpoint volume "
                     rf"{ckpt} \(full: [\d.]+ MiB free of [\d.]+ MiB\); nothing of it is resumed from\n",
                     result.stdout), result.stdout[-4000:]
    assert "Traceback" not in result.stdout, result.stdout[-4000:]
    assert checkpoint.is_complete(ckpt / "step_00000002") and not checkpoint.is_complete(ckpt / "step_00000004")
    assert (ckpt / "latest").read_text() == "step_00000002"


def test_a_hugging_face_model_from_a_local_config_trains(tmp_path):
    pytest.importorskip("transformers")
    hf = tmp_path / "tiny-gpt2"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, '
                                    '"vocab_size": 256, "n_positions": 64}')
    ds_config = write_ds_config(tmp_path, cpu_ds_config())
    ckpt = tmp_path / "ckpt"
    result = run_train(["--ds-config", str(ds_config), "--steps", "20", "--model.hf-config", str(hf),
                        "--checkpoint-dir", str(ckpt), *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    run = losses(ckpt)
    assert run[20] < run[1] * 0.8
    assert f"M parameters (gpt2 from {hf}) |" in result.stdout


def test_token_file_training(tmp_path):
    text = ("The quick brown fox jumps over the lazy dog. " * 400)
    (tmp_path / "corpus.txt").write_text(text)
    from train.tokenize import main as tokenize
    assert tokenize([str(tmp_path / "corpus.txt"), str(tmp_path / "tokens.bin")]) == 0
    ds_config = write_ds_config(tmp_path, cpu_ds_config())
    ckpt = tmp_path / "ckpt"
    result = run_train(["--ds-config", str(ds_config), "--steps", "20", "--data.path", str(tmp_path / "tokens.bin"),
                        "--checkpoint-dir", str(ckpt), *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    run = losses(ckpt)
    assert run[20] < run[1] * 0.7


# ---- errors that must stop a run before training, naming the file/key and what was expected

ERRORS = {
    "unknown top-level ds_config key": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config(trian_batch_size=8)))],
        "unknown top-level key 'trian_batch_size' (did you mean 'train_batch_size'?)"),
    "misspelt optimizer section": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, {**cpu_ds_config(), "optimzer": {}}))],
        "unknown top-level key 'optimzer' (did you mean 'optimizer'?)"),
    "missing ds_config": (lambda tmp: ["--ds-config", str(tmp / "nope.json")], "nope.json: cannot read"),
    "ds_config not JSON": (lambda tmp: ["--ds-config", str(write_text(tmp / "bad.json", "{'a': 1"))],
                           "bad.json: not valid JSON"),
    "global batch mismatch": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config(micro=4, accum=2, train_batch_size=12)))],
        "train_batch_size 12 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x 1 data-parallel "
        "rank"),
    "unknown key inside a section": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config(zero_optimization={"stage": 2,
                                                                                              "stgae": 3})))],
        "DeepSpeed rejects it: ValidationError: DeepSpeedZeroConfig.stgae: Extra inputs are not permitted"),
    "data file too small": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config())), "--data.path",
                     str(write_bytes(tmp / "tiny.bin", np.arange(50, dtype="<u2").tobytes()))],
        "tiny.bin: 50 tokens is too small for one batch"),
    "checkpoint dir not writable": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config())), "--checkpoint-dir",
                     str(write_text(tmp / "a-file", "x") / "ckpt")],
        "a-file/ckpt: not writable"),
    "unknown train config key": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config())), "--config",
                     str(write_text(tmp / "train.yaml", "steps: 5\nmodel:\n  n_layers: 2\n"))],
        "train.yaml: unknown key model.'n_layers'"),
    "bad model shape": (
        lambda tmp: ["--ds-config", str(write_ds_config(tmp, cpu_ds_config())), "--model.d-model", "65"],
        "model.d_model must be a multiple of model.n_head (4), got 65"),
}


def write_text(path, text):
    path.write_text(text)
    return path


def write_bytes(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", ERRORS, ids=ERRORS.keys())
def test_bad_input_stops_before_training_with_a_clear_message(tmp_path, case):
    make_args, message = ERRORS[case]
    result = run_single([*TINY, *make_args(tmp_path), "--steps", "5"])
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert message in output, output[-3000:]
    assert "step 1/" not in output


def test_help_documents_the_contract():
    result = run_single(["--help"])
    for flag in ("--ds-config", "--config", "--steps", "--checkpoint-dir", "--log-every", "--checkpoint-every",
                 "--keep-checkpoints", "--model.n-layer", "--data.path"):
        assert flag in result.stdout


def test_ds_config_monitor_section_records_the_loss(tmp_path):
    monitor = {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "run"}
    ds_config = write_ds_config(tmp_path, cpu_ds_config(csv_monitor=monitor))
    result = run_train(["--ds-config", str(ds_config), "--steps", "6", "--log-every", "3", *TINY])
    assert result.returncode == 0, result.stdout[-4000:]
    files = {p.name: p for p in (tmp_path / "monitor").rglob("*.csv")}
    assert "Train_Samples_train_loss.csv" in files and "Train_Samples_lr.csv" in files, files
    rows = files["Train_Samples_train_loss.csv"].read_text().splitlines()
    assert len(rows) == 1 + 6  # header and one row per step


def listening(port: int) -> bool:
    """Something on this machine listens on the TCP port (/proc/net/tcp*, state 0A): no connection is made."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            if any(int(row.split()[1].rsplit(":", 1)[1], 16) == port and row.split()[3] == "0A"
                   for row in list(rows)[1:]):
                return True
    return False


def test_a_run_past_its_time_is_stopped_with_each_ranks_stack(tmp_path):
    """What a rare hang leaves its reader: where each rank was blocked when the harness gave up on it. Rank 0 of
    two, alone, waits in the rendezvous for rank 1 forever."""
    ds_config = write_ds_config(tmp_path, cpu_ds_config())
    args = ["--ds-config", str(ds_config), "--steps", "2", *TINY]
    argv, env = launch_argv_env(args, ranks=2)[0]
    process = Ranks(args, [(argv, env)])
    wait_for(lambda: listening(int(env["MASTER_PORT"])) or process.processes[0].poll() is not None, 120,
             "rank 0 to listen for its peers")
    assert process.processes[0].poll() is None, "rank 0 ended before its rendezvous"
    out = stop_with_stacks(process)
    assert "Fatal Python error: Aborted" in out and "Current thread" in out, out[-3000:]
    assert "in init_process_group" in out, out[-3000:]  # the frame it was blocked in


def test_a_non_finite_loss_ends_the_attempt_before_its_state_is_saved_and_says_so_to_the_ledger(tmp_path):
    """A learning rate that blows the weights up: the mean loss turns NaN (or inf) at some step; every rank stops
    there (they share the mean), before the checkpoint of that step, with one line and an end record (loss-nan).
    stop_on_nonfinite_loss: false trains on."""
    ds_config = write_ds_config(tmp_path, cpu_ds_config(optimizer={"type": "AdamW", "params": {
        "lr": 1e30, "weight_decay": 0.0, "torch_adam": True}}, gradient_clipping=0.0))
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    args = ["--ds-config", str(ds_config), "--steps", "12", "--checkpoint-every", "1", "--log-every", "1",
            "--checkpoint-dir", str(ckpt), "--checkpoint-background", "false", *TINY]
    result = run_train(args, env_extra={protocol.STATE_DIR_ENV: str(state), "DS_RUN_ID": "run-0001-test"})
    assert result.returncode == 1, result.stdout[-4000:]
    found = re.search(r"ERROR loss is (nan|inf) at step (\d+) \(the mean over ranks\): stopped before saving this "
                      r"state", result.stdout)
    assert found and "Traceback" not in result.stdout, result.stdout[-4000:]
    bad = int(found[2])
    ends = [json.loads(p.read_text()) for p in sorted(state.glob("end-*.json"))]
    assert [(e["rank"], e["cause"], e["step"]) for e in ends] == [(0, "loss-nan", bad), (1, "loss-nan", bad)], ends
    assert not (ckpt / checkpoint.tag_for(bad)).exists()  # the NaN state was never saved
    if bad > 1:
        assert (ckpt / "latest").read_text() == checkpoint.tag_for(bad - 1)
    on = run_train([*args, "--stop-on-nonfinite-loss", "false", "--checkpoint-dir", str(tmp_path / "on")])
    assert on.returncode == 0 and "INFO done: 12 steps" in on.stdout, on.stdout[-3000:]
