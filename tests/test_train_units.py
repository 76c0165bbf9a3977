"""In-process checks of the train package's pieces: config, ds_config checks, data sharding, tokenizer."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from podruntime import protocol
from train import dsconfig
from train.config import ConfigError, DataConfig, ModelConfig, parse_args
from train.data import DataError, SyntheticData, TokenFileData, samples
from train.layout import Layout, LayoutError
from train.report import Stragglers
from train.tokenize import decode, encode

ROOT = Path(__file__).resolve().parent.parent


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("steps: 50\nlog_every: 5\nmodel:\n  n_layer: 6\n  d_model: 96\n")
    cfg = parse_args(["--ds-config", "ds.json", "--config", str(path), "--steps", "7", "--model.n-head", "8"])
    assert (cfg.steps, cfg.log_every, cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model) == (7, 5, 6, 8, 96)
    assert cfg.ds_config == "ds.json" and cfg.model.seq_len == ModelConfig().seq_len


def test_config_file_types_are_checked(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('{"steps": "ten"}')
    with pytest.raises(ConfigError, match=r"train.json: steps must be int, got 'ten'"):
        parse_args(["--ds-config", "ds.json", "--config", str(path)])


def test_a_moved_key_says_where_it_went(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('{"dist_timeout_s": 30}')
    with pytest.raises(ConfigError, match=r"train.json: dist_timeout_s is no longer a train config key: it is the "
                                          r"chart value deepspeed.collectiveTimeoutMinutes"):
        parse_args(["--ds-config", "ds.json", "--config", str(path)])


def test_boolean_flags_take_false_as_false():
    assert parse_args(["--ds-config", "x"]).checkpoint_background is True
    cfg = parse_args(["--ds-config", "x", "--checkpoint-background", "false", "--reset-optimizer", "no"])
    assert (cfg.checkpoint_background, cfg.reset_optimizer) == (False, False)
    assert parse_args(["--ds-config", "x", "--reset-optimizer", "true"]).reset_optimizer is True
    with pytest.raises(ConfigError, match=r"argument --checkpoint-background: invalid boolean value: 'maybe'"):
        parse_args(["--ds-config", "x", "--checkpoint-background", "maybe"])


def test_a_background_saves_snapshot_is_a_compact_copy_training_cannot_change():
    import collections

    import torch

    from train.checkpoint import snapshot

    flat = torch.arange(8, dtype=torch.float32)
    state = collections.OrderedDict(view=flat[2:4], shape=torch.Size([2]), step=3, groups=[{"lr": 0.1}],
                                    pair=(flat[:1], "x"))
    state._metadata = {"": {"version": 1}}
    copy = snapshot(state)
    flat.add_(100)  # the next optimizer step, in place
    state["groups"][0]["lr"] = 0.5
    assert copy["view"].tolist() == [2.0, 3.0] and copy["view"].untyped_storage().nbytes() == 8
    assert copy["pair"][0].tolist() == [0.0] and copy["pair"][1] == "x"
    assert copy["groups"][0]["lr"] == 0.1 and copy["step"] == 3 and copy["shape"] == torch.Size([2])
    assert type(copy) is collections.OrderedDict and copy._metadata == {"": {"version": 1}}


def test_ds_config_is_required():
    with pytest.raises(ConfigError, match=r"ds_config must be a path \(--ds-config\)"):
        parse_args([])


@pytest.mark.parametrize("world, given, expected", [
    (2, {"train_micro_batch_size_per_gpu": 4}, (4, 1, 8)),
    (2, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, (4, 3, 24)),
    (4, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, (4, 4, 64)),
    (4, {"train_batch_size": 64, "gradient_accumulation_steps": 2}, (8, 2, 64)),
    (8, {"train_batch_size": 64}, (8, 1, 64)),
    (2, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, (2, 4, 16)),
])
def test_batch_sizes_are_completed_as_deepspeed_does(world, given, expected):
    assert dsconfig.batch_sizes(given, Layout(world), "x.json") == expected


@pytest.mark.parametrize("given, message", [
    ({}, "set train_micro_batch_size_per_gpu or train_batch_size"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, "not divisible"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, "!="),
    ({"train_micro_batch_size_per_gpu": 0}, "must be an integer >= 1"),
    ({"train_micro_batch_size_per_gpu": "4"}, "must be an integer >= 1"),
])
def test_batch_arithmetic_errors_name_the_file(given, message):
    with pytest.raises(dsconfig.DsConfigError, match="ds_config x.json: .*" + message):
        dsconfig.batch_sizes(given, Layout(2), "x.json")


def test_load_rejects_a_non_object(tmp_path):
    (tmp_path / "ds.json").write_text("[1, 2]")
    with pytest.raises(dsconfig.DsConfigError, match="expected a JSON object"):
        dsconfig.load(tmp_path / "ds.json")


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_token_file_order_covers_every_window_once_per_epoch_whatever_the_world_size(tmp_path, world):
    length = 10_007
    (tmp_path / "t.bin").write_bytes((np.arange(length) % 256).astype("<u2").tobytes())
    model, cfg = ModelConfig(seq_len=16), DataConfig(path=str(tmp_path / "t.bin"))
    data = TokenFileData(cfg, model, 0, world, micro_batch=2)
    offsets = data.window_offsets(epoch=0)
    assert len(set(offsets)) == len(offsets) == data.windows == (length - 1) // 16
    assert offsets.max() + model.seq_len + 1 <= length
    # A step of micro 2 on `world` ranks reads the same samples as one rank reading them all.
    alone = TokenFileData(cfg, model, 0, 1, micro_batch=2).batch(0, 2 * world)[0]
    ranks = [TokenFileData(cfg, model, r, world, 2).batch(samples(0, 2, r), 2)[0] for r in range(world)]
    assert np.array_equal(np.concatenate(ranks), alone)
    inputs, targets = data.batch(0, 2)
    assert inputs.shape == (2, 16) and np.array_equal(inputs[:, 1:], targets[:, :-1])


def test_token_file_position_replays_the_same_samples(tmp_path):
    (tmp_path / "t.bin").write_bytes((np.arange(5000) % 256).astype("<u2").tobytes())
    cfg, model = DataConfig(path=str(tmp_path / "t.bin")), ModelConfig(seq_len=8)
    first, again = (TokenFileData(cfg, model, 0, 2, 4) for _ in range(2))
    sequence = [first.batch(p, 4)[0] for p in range(0, 400, 4)]  # crosses epoch boundaries
    assert all(np.array_equal(again.batch(p, 4)[0], sequence[i]) for i, p in enumerate(range(0, 400, 4)))


def test_token_ids_must_fit_the_vocabulary(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.full(1000, 300, dtype="<u2").tobytes())
    with pytest.raises(DataError, match="token id 300 >= model.vocab_size 256"):
        TokenFileData(DataConfig(path=str(tmp_path / "t.bin")), ModelConfig(seq_len=8), 0, 1, 2)


def test_synthetic_samples_depend_on_their_index_only():
    cfg, model = DataConfig(), ModelConfig(seq_len=16)
    rank0, rank1 = SyntheticData(cfg, model, 0, 2), SyntheticData(cfg, model, 1, 3)
    assert not np.array_equal(rank0.batch(0, 4)[0], rank0.batch(4, 4)[0])
    assert np.array_equal(rank0.batch(8, 4)[0], rank1.batch(8, 4)[0])  # any rank, any world size
    assert np.array_equal(rank0.batch(8, 4)[0], np.concatenate([rank1.batch(8 + i, 1)[0] for i in range(4)]))


def test_tokenizer_round_trips_text():
    text = "DeepSpeed — ZeRO 3, ünïcode ✓"
    tokens = encode(text)
    assert tokens.dtype == np.dtype("<u2") and tokens.max() < 256
    assert decode(tokens) == text


PROGRAM_THAT_RAISES = """
import sys
from train import rankstate
rankstate.report("starting")
rankstate.beat(5)
raise {error}
"""


@pytest.mark.parametrize("error, cause, line", [
    ("ZeroDivisionError('division by zero')", "program-error", "ZeroDivisionError: division by zero"),
    ("RuntimeError('[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv "
     "operation to complete')", "collective-timeout", "RuntimeError: [../third_party/gloo/gloo/transport/tcp/"
     "unbound_buffer.cc:81] Timed out waiting 60000ms for recv operation to complete"),
    ("TimeoutError('the data loader timed out')", "program-error", "TimeoutError: the data loader timed out"),
])
def test_a_programs_uncaught_exception_is_its_end_record_and_python_still_prints_it(tmp_path, error, cause, line):
    """Any program that reports through rankstate (the Trainer callback, a bring-your-own loop) leaves its last
    line for the ledger: rankstate's excepthook runs before Python's own, which still prints the traceback."""
    import subprocess
    import sys

    from podruntime import protocol
    state = tmp_path / "ranks"
    result = subprocess.run([sys.executable, "-c", PROGRAM_THAT_RAISES.format(error=error)], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1], timeout=60,
                            env={**os.environ, protocol.STATE_DIR_ENV: str(state), "RANK": "3",
                                 "DS_RUN_ID": "run-0002-abc"})
    assert result.returncode == 1 and "Traceback" in result.stderr and line in result.stderr, result.stderr
    record = json.loads((state / protocol.END_RECORD.format(rank=3)).read_text())
    assert protocol.valid_end_record(record) == record
    assert (record["run"], record["rank"], record["cause"], record["line"], record["step"]) == \
        ("run-0002-abc", 3, cause, line, 5), record


def test_the_first_end_record_of_a_run_wins(tmp_path, monkeypatch):
    """A rank that said why it ends (a NaN loss) and then fails in its teardown keeps its first word."""
    from podruntime import protocol
    from train import rankstate
    monkeypatch.setenv(protocol.STATE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("DS_RUN_ID", "run-0001-a")
    rankstate.fail("loss-nan", "loss is nan at step 3")
    rankstate.record_exception(RuntimeError("Connection closed by peer"))
    assert json.loads((tmp_path / "end-0.json").read_text())["cause"] == "loss-nan"
    monkeypatch.setenv("DS_RUN_ID", "run-0002-a")  # the next attempt's own word
    rankstate.record_exception(RuntimeError("Connection closed by peer"))
    assert json.loads((tmp_path / "end-0.json").read_text())["line"] == "RuntimeError: Connection closed by peer"


GROUP_TIMEOUTS = """
import datetime, sys, torch, torch.distributed as dist
from train.deepspeed_mirror import groups_take_the_timeout
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
before = dist.new_group([0])
groups_take_the_timeout(datetime.timedelta(seconds=60))
groups_take_the_timeout(datetime.timedelta(seconds=60))  # twice: still one wrapper
from deepspeed.comm.torch import TorchBackend
clone = TorchBackend.new_group(None, [0])  # DeepSpeed's own call, as ZeRO clones the world group
own = dist.new_group([0], timeout=datetime.timedelta(seconds=5))
print([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in (before, clone, own)])
"""


def test_deepspeeds_own_groups_take_the_runs_collective_timeout_not_torchs_30_minutes(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", GROUP_TIMEOUTS, str(tmp_path / "store")], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[1800.0, 60.0, 5.0]", result.stdout


def test_rank_state_is_written_atomically_where_the_chart_says_and_cleared(tmp_path, monkeypatch):
    from podruntime import protocol
    from train import rankstate
    monkeypatch.setenv("DS_RANK_STATE_DIR", str(tmp_path / "ranks"))
    monkeypatch.setenv("RANK", "1")
    for state in rankstate.STATES:
        rankstate.report(state)
        assert (tmp_path / "ranks" / str(os.getpid())).read_text() == f"{state} rank=1 v={protocol.VERSION}\n"
    state = tmp_path / "ranks" / str(os.getpid())
    rankstate.beat(7)  # the first beat after another state replaces the file
    assert state.read_text() == f"training rank=1 step=7 v={protocol.VERSION}\n"
    rankstate.beat(9)  # then written in place: two steps later, the smoothed step time is measured
    words = state.read_text().split()
    assert words[:3] == ["training", "rank=1", "step=9"] and words[3].startswith("step_s=") and len(words) == 5
    rankstate.report("saving")  # a new state replaces the file again, and the next beat too
    assert state.read_text().split()[0] == "saving"
    rankstate.beat(10)
    assert state.read_text().split()[:3] == ["training", "rank=1", "step=10"]
    # No temporary file left; the stack dump's file is open, its diagnostics FIFO served; rank 0 alone publishes.
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == [
        str(os.getpid()), f"{os.getpid()}.diag", f"{os.getpid()}.stacks"]
    monkeypatch.setenv("RANK", "0")
    rankstate.beat(11)
    rankstate.publish(loss=float("nan"), steps=20)
    published = json.loads((tmp_path / "ranks" / rankstate.PROGRESS).read_text())
    assert published["step"] == 11 and published["steps"] == 20 and published["loss"] == "nan"
    rankstate.clear()  # the progress stays: the sidecar's last word on the run
    assert [p.name for p in (tmp_path / "ranks").iterdir()] == [rankstate.PROGRESS]
    monkeypatch.delenv("DS_RANK_STATE_DIR")
    rankstate.report("starting")  # outside the chart: nothing written, nothing raised


def test_a_checkpoint_slower_to_save_than_the_sigterm_grace_is_warned_about(tmp_path, monkeypatch, caplog):
    import logging

    from train import checkpoint
    logger = logging.getLogger("test-grace")
    monkeypatch.setenv("DS_KILL_GRACE_SECONDS", "20")
    with caplog.at_level(logging.WARNING, logger="test-grace"):
        checkpoint.check_save_fits_grace({"save_s": 12.5}, tmp_path, logger)
        assert not caplog.records
        checkpoint.check_save_fits_grace({"save_s": 31.0}, tmp_path, logger)
    assert "took 31s to save, but a SIGTERM (eviction, preemption, upgrade) leaves the ranks 20s" in caplog.text


def test_model_flops_per_token_follow_palm_by_hand():
    from train import mfu
    from train.model import GPT
    assert mfu.flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32
    # 1 layer, width 8, vocab 16, context 4. Weights that multiply: token embedding = tied output projection
    # 16*8 = 128 (once); block: 2 LayerNorms 2*16, qkv 8*24+24, proj 8*8+8, MLP 8*32+32 and 32*8+8 = 872;
    # final LayerNorm 16. The position embedding (4*8) is a lookup: left out.
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=8, vocab_size=16, seq_len=4))
    assert mfu.model_flops_per_token(model, *model.shape(), 4) == 6 * (128 + 872 + 16) + 12 * 1 * 8 * 4 == 6480
    assert mfu.mfu(1000.0, 6480, 1e-6) == pytest.approx(1000 * 6480 / 1e6)
    assert mfu.mfu(1000.0, 6480, None) is None


@pytest.mark.parametrize("name, half, peak", [
    ("NVIDIA H200", True, 989.5), ("NVIDIA H100 80GB HBM3", True, 989.4), ("NVIDIA H100 PCIe", True, 756.0),
    ("NVIDIA A100-SXM4-80GB", False, 156.0), ("NVIDIA GB200", True, 2500.0), ("NVIDIA B200", True, 2250.0),
    ("NVIDIA L40S", True, 362.0), ("NVIDIA L4", True, 121.0), ("NVIDIA A10G", True, 70.0),
    ("Tesla V100-PCIE-32GB", True, 112.0), ("AMD Instinct MI300X", True, 1307.4), ("cpu", True, None),
])
def test_peak_flops_match_the_most_specific_device_name(name, half, peak):
    from train import mfu
    assert mfu.peak_tflops(name, half) == peak


@pytest.mark.parametrize("world, stages, data_parallel, text", [
    (8, 1, 8, "8 data-parallel ranks"), (1, 1, 1, "1 data-parallel rank"),
    (8, 2, 4, "4 data-parallel ranks (8 ranks / 2 pipeline stages)")])
def test_a_layout_counts_data_parallel_ranks_once(world, stages, data_parallel, text):
    layout = Layout(world, stages)
    assert (layout.data_parallel, layout.describe()) == (data_parallel, text)
    assert [layout.data_rank(r) for r in range(world)] == [r % data_parallel for r in range(world)]


@pytest.mark.parametrize("world, stages, message", [
    (6, 4, "model.pipeline_stages 4 must divide the world size 6"), (0, 1, "world_size must be an integer >= 1"),
    (4, True, "pipeline_stages must be an integer >= 1"), (4, 2.0, "pipeline_stages must be an integer >= 1")])
def test_a_layout_the_ranks_cannot_form_is_refused(world, stages, message):
    with pytest.raises(LayoutError, match=message):
        Layout(world, stages)


def test_goodput_splits_every_attempt_and_leaves_odd_records_out(tmp_path, monkeypatch):
    """Three attempts as train/main.py records them: the first crashed after step 25 (its last save at 20), the
    second hung after step 32 (the watchdog's report came 12 s later: the ledger gives the third attempt that time),
    the third finished. A hand-edited record and a truncated one are left out, never a crash at the end of a run."""
    from train import goodput
    job = tmp_path / "goodput" / "abcd1234"
    job.mkdir(parents=True)
    t0 = 1_000_000.0

    def record(attempt, begun, first, restore, saves, productive, at_step, resumed, last, updated, run, **previous):
        (job / f"{int(begun * 1000):014d}-{attempt:04d}.json").write_text(json.dumps(
            {"begun": begun, "first_step": first, "restore_s": restore, "save_s": saves, "productive_s": productive,
             "at_step": at_step, "resumed_from": resumed, "last_step": last, "updated": updated, "run": run,
             **previous}))

    record(1, t0, t0 + 10, 0.0, 1.0, 25.0, {"10": 10.0, "20": 20.0}, 0, 24, t0 + 36, "run-0001-abcd1234")
    (job / f"{int(t0 * 1000):014d}-0001.step").write_text("25 26.000000 1000037.000000\n")  # after the last flush
    record(2, t0 + 38, t0 + 45, 1.0, 0.5, 12.0, {"30": 10.0}, 20, 32, t0 + 58.5, "run-0002-abcd1234",
           previous_run="run-0001-abcd1234", previous_hung_at=None)
    (job / "00000000000004-0004.json").write_text('{"begun": "yesterday"}')
    (job / "00000000000005-0005.json").write_text('{"begun": 1')
    monkeypatch.setenv("DS_RUN_ID", "run-0003-abcd1234")
    monkeypatch.setenv("DS_ATTEMPT", "3")
    monkeypatch.setenv("DS_ATTEMPT_BEGUN", str(t0 + 72))
    monkeypatch.setenv("DS_PREVIOUS_RUN_ID", "run-0002-abcd1234")
    monkeypatch.setenv("DS_PREVIOUS_RUN_HUNG_AT", str(t0 + 70.5))
    third = goodput.Goodput(tmp_path, 30, 1.5)
    # The records of a release from the layout before _job/ are moved there once, and read.
    assert (tmp_path / "_job" / "goodput" / "abcd1234").is_dir() and not (tmp_path / "goodput").exists()
    third.step(31, t0 + 80, 1.0)
    third.saved(31, 0.5)
    third.record["updated"] = t0 + 81.5
    split = third.job()
    # Attempt 1: 26 s of steps (the last one from its .step line), 6 after the save at step 20 that attempt 2
    # resumed from; it ended at 37. Attempt 2: 12 s, 2 after step 30; hung from its last step (58.5) to the report
    # (70.5); 1 s of its span (45 to 58.5) is neither steps nor saves. Start-up: 10, 45 - 37 - 1, 80 - 70.5 - 1.5.
    assert split == {"productive": 20.0 + 10.0 + 1.0, "recomputation": 6.0 + 2.0, "startup": 10.0 + 7.0 + 8.0,
                     "restore": 0.0 + 1.0 + 1.5, "save": 1.0 + 0.5 + 0.5, "hung": 12.0, "wall": 81.5,
                     "unaccounted": 1.0, "attempts": 3}, split
    assert goodput.describe(split).startswith("goodput 38.0% | wall 81.5s = productive 31.0s + start-up 25.0s")
    # The fault before attempt 3 by its parts: hung from 58.5 to the report at 70.5, the attempt's end not given
    # (its time goes to reschedule, to 72), start 80 - 72 - 1.5, the restore, the first step, 2 s trained again.
    fault = third.last_fault()
    assert fault == {"detect": 12.0, "reschedule": 1.5, "start": 6.5, "load": 1.5, "first_step": 1.0,
                     "recompute": 2.0, "total": 24.5, "attempt": 3}, fault
    assert goodput.describe_fault(fault) == ("attempt 3 lost 24.5s to the fault before it: detect 12.0s + reschedule "
                                             "1.5s + start 6.5s + load 1.5s + first step 1.0s + recompute 2.0s")
    assert goodput.published(split, fault)["fault"] == fault


def _attempts(t0: float, **after):
    """A failed attempt's record (its last step ended at t0 + 10; 9 s of steps, 4 of them by its save at step 5) and
    the next one's, which resumed from step 5 and began at t0 + 34 (`after` changes it)."""
    before = {"begun": t0, "first_step": t0 + 1, "restore_s": 0.0, "save_s": 0.0, "productive_s": 9.0,
              "at_step": {"5": 4.0}, "resumed_from": 0, "last_step": 9, "updated": t0 + 10, "run": "run-0001-abcd1234"}
    return before, {"begun": t0 + 34, "first_step": t0 + 40, "first_step_s": 1.0, "restore_s": 1.5,
                    "rendezvous_s": 0.5, "save_s": 0.0, "productive_s": 1.0, "at_step": {}, "resumed_from": 5,
                    "last_step": 6, "updated": t0 + 41, "run": "run-0002-abcd1234", "previous_run": before["run"],
                    **after}


@pytest.mark.parametrize("after, parts", [
    # a hang: reported 20 s after the last step, every rank ended 3 s later, the next attempt began 1 s after that
    ({"previous_hung_at": 1_000_030.0, "previous_ended": 1_000_033.0},
     {"detect": 20.0, "stop": 3.0, "reschedule": 1.0, "start": 4.0, "rendezvous": 0.5}),
    # a crash: a rank said why 1 s after the last step
    ({"previous_failed_at": 1_000_011.0, "previous_ended": 1_000_012.0},
     {"detect": 1.0, "stop": 1.0, "reschedule": 22.0, "start": 4.0, "rendezvous": 0.5}),
    # the ledger's times of another run, or outside the gap they describe: left out, their time in the next part
    ({"previous_run": "run-0009-abcd1234", "previous_failed_at": 1_000_011.0, "previous_ended": 1_000_012.0},
     {"reschedule": 24.0, "start": 4.0, "rendezvous": 0.5}),
    ({"previous_failed_at": 1_000_009.0, "previous_ended": 1_000_035.0},
     {"reschedule": 24.0, "start": 4.0, "rendezvous": 0.5}),
    # what the program wrote in its own record: a rendezvous longer than the start or not a number is not known
    ({"previous_ended": 1_000_012.0, "rendezvous_s": 99.0}, {"stop": 2.0, "reschedule": 22.0, "start": 4.5}),
    ({"previous_ended": 1_000_012.0, "rendezvous_s": "nan"}, {"stop": 2.0, "reschedule": 22.0, "start": 4.5}),
    ({"previous_ended": 1_000_012.0, "restore_s": 1e9, "rendezvous_s": None},
     {"stop": 2.0, "reschedule": 22.0, "start": 0.0, "load": 6.0}),
])
def test_a_faults_loss_is_split_at_the_ledgers_moments_and_every_second_is_in_one_part(after, parts):
    from train import goodput
    t0 = 1_000_000.0
    before, record = _attempts(t0, **after)
    fault = goodput.fault_parts(before, record)
    expected = {"load": 1.5, "first_step": 1.0, "recompute": 5.0, **parts}
    assert {k: v for k, v in fault.items() if k not in ("total", "attempt")} == expected, fault
    # From the last step before the fault to the end of the first step after it, plus the steps trained again.
    assert fault["total"] == pytest.approx((t0 + 41) - (t0 + 10) + 5.0) and fault["attempt"] == 2
    assert list(fault)[:-2] == [p for p in protocol.FAULT_PARTS if p in fault]
    assert goodput.fault_parts(before, {**record, "first_step": None, "first_step_s": None}) is None



@pytest.mark.parametrize("previous_run, hung_at", [
    ("run-0001-abcd1234", "1000030.0"),  # the ledger's word for the run before: 20 s hung after its last step
    ("run-0007-ffff0000", "1000030.0"),  # a run the record before is not: its next attempt never wrote a record
    ("run-0001-abcd1234", "soon"), ("run-0001-abcd1234", "nan"), ("run-0001-abcd1234", "")])
def test_goodput_counts_time_hung_only_from_the_ledgers_word_on_the_run_before(tmp_path, monkeypatch, previous_run,
                                                                                hung_at):
    from train import goodput
    job = tmp_path / "_job" / "goodput" / "abcd1234"
    job.mkdir(parents=True)
    t0 = 1_000_000.0
    (job / f"{int(t0 * 1000):014d}-0001.json").write_text(json.dumps(
        {"begun": t0, "first_step": t0 + 1, "restore_s": 0.0, "save_s": 0.0, "productive_s": 9.0, "at_step": {},
         "resumed_from": 0, "last_step": 9, "updated": t0 + 10, "run": "run-0001-abcd1234"}))
    monkeypatch.setenv("DS_RUN_ID", "run-0002-abcd1234")
    monkeypatch.setenv("DS_ATTEMPT_BEGUN", str(t0 + 31))
    monkeypatch.setenv("DS_PREVIOUS_RUN_ID", previous_run)
    monkeypatch.setenv("DS_PREVIOUS_RUN_HUNG_AT", hung_at)
    second = goodput.Goodput(tmp_path, 0, 0.0)
    second.step(1, t0 + 32, 1.0)
    split = second.job()
    counted = previous_run == "run-0001-abcd1234" and hung_at == "1000030.0"
    assert split["hung"] == (20.0 if counted else 0.0), split
    assert split["startup"] == (1.0 + 2.0 if counted else 1.0 + 22.0), split
    assert split["wall"] == 33.0 and split["unaccounted"] == 0.0, split


class _Lines:
    """A logger that keeps what Stragglers warns."""
    def __init__(self):
        self.lines = []

    def warning(self, line):
        self.lines.append(line)


def test_a_straggler_over_the_ratio_for_a_run_of_steps_is_named_once_and_ranks_inside_it_never():
    lines, hosts = _Lines(), ["w-0", "w-1", "w-2", "w-3"]
    stragglers = Stragglers(lines, hosts)
    # Balanced ranks whose noise stays under the ratio: nobody, however long.
    for step in range(200):
        stragglers.step([0.100, 0.100 * (1 + 0.19 * (step % 2)), 0.095, 0.105])
    assert lines.lines == []
    # Rank 2 over it for one step short of a run, then back: the run starts again.
    for _ in range(Stragglers.RUN - 1):
        stragglers.step([0.100, 0.100, 0.300, 0.100])
    stragglers.step([0.100, 0.100, 0.100, 0.100])
    for _ in range(Stragglers.RUN - 1):
        stragglers.step([0.100, 0.100, 0.300, 0.100])
    assert lines.lines == []
    # The run completes: one line with its host and its time against the median; then quiet for QUIET_S.
    for _ in range(3 * Stragglers.RUN):
        stragglers.step([0.100, 0.100, 0.300, 0.100])
    assert lines.lines == ["straggler: rank 2 (w-2) took 300 ms of its own compute per step against a median of "
                           "100 ms (3.0x) for the last 10 steps: every rank waits for it"]


def test_a_pipelines_unmeasured_steps_name_no_straggler():
    lines = _Lines()
    stragglers = Stragglers(lines, ["w-0", "w-1"])
    for _ in range(3 * Stragglers.RUN):
        stragglers.step([0.0, 0.0])
    assert lines.lines == []


def test_a_sigterm_handler_that_reports_stopping_in_the_middle_of_a_beat_never_crashes_the_rank(tmp_path, monkeypatch):
    """The train package's SIGTERM handler reports `stopping` (closing the state file beat() writes in place) at
    whatever bytecode the main thread is: here between beat()'s check of the file and its write (the rank crashed
    with a TypeError there when every host's ranks got SIGTERM at once). The stop's state stands."""
    from train import rankstate
    monkeypatch.setenv("DS_RANK_STATE_DIR", str(tmp_path / "ranks"))
    monkeypatch.setenv("RANK", "1")
    rankstate.beat(7)  # the file open for in-place beats
    real = rankstate._rank
    handled = []

    def rank_then_the_signal():
        if not handled:
            handled.append(True)
            rankstate.report("stopping")  # what the handler does, at this point of beat()
        return real()

    monkeypatch.setattr(rankstate, "_rank", rank_then_the_signal)
    rankstate.beat(8)
    assert handled and (tmp_path / "ranks" / str(os.getpid())).read_text().split()[0] == "stopping"
    rankstate.clear()
