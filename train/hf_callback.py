"""Hang detection, progress and goodput for Hugging Face Trainer programs, at the cost of one line:
`Trainer(..., callbacks=[RankHeartbeat()])`. It reports through the train package's own reporter
(train/report.py Reporter): the rank beats after every optimizer step (train/rankstate.py, which the chart's
watchdog reads), reports `saving` while the Trainer writes a checkpoint and stays alive through evaluation, so that
neither is taken for a hang; the watchdog's stack dump works from the first report. On per-worker checkpoint volumes
it completes each worker's copy of a checkpoint (mark_latest). Rank 0 also publishes what the Trainer logs (loss,
learning rate, total steps, the last checkpoint, the ETA), which the chart's progress ConfigMap and metrics show,
and keeps the job's goodput records (train/goodput.py) in DS_CHECKPOINT_DIR (else the output dir), printing the
split at the end.

What the Trainer's hooks can measure differs from the train package in two places: a checkpoint restore runs before
any callback (`on_train_begin`), so it counts as start-up here; and an evaluation's time, which is none of the
buckets, shows as unaccounted."""

import os
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from train import checkpoint, rankstate
from train.goodput import describe as goodput_line
from train.report import Reporter


def mark_latest(directory: Path, step: int) -> None:
    """DeepSpeed writes a checkpoint's `latest` (the tag its load_checkpoint() reads) on global rank 0 only: on
    per-worker volumes (the chart's DS_CHECKPOINT_STORAGE) each other worker's local main process writes its own,
    once its ranks' files of the tag are there, or its next attempt could not resume."""
    tag = f"global_step{step}"
    if (directory / tag).is_dir() and not (directory / "latest").exists():
        checkpoint.write_atomic(directory / "latest", tag)


class RankHeartbeat(TrainerCallback):
    def __init__(self):
        self._reporter: Reporter | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        # The Trainer has loaded its checkpoint by now: global_step is where it resumed.
        self._reporter = Reporter(Path(os.environ.get("DS_CHECKPOINT_DIR") or args.output_dir),
                                  0 if state.is_world_process_zero else 1)
        self._reporter.resumed(state.global_step, state.max_steps or None, restore_s=0.0)
        # The first step counts from here, not on_step_begin: the Trainer fetches a step's batches before that hook.
        self._reporter.step_begins()

    def on_step_end(self, args, state, control, **kwargs):
        fault = self._reporter.step(state.global_step)
        if fault:
            print(fault, flush=True)  # the first step of a retry: what the fault before it cost, by its parts
        if control.should_save:  # the Trainer's own flow callback, which runs first, asked for a save next
            self._reporter.saving(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if state.is_local_process_zero and os.environ.get(checkpoint.STORAGE_ENV) == checkpoint.PER_WORKER:
            mark_latest(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", state.global_step)
        self._reporter.saved(state.global_step)
        rankstate.publish(checkpoint_step=state.global_step)

    def on_evaluate(self, args, state, control, **kwargs):
        self._reporter.not_a_step()  # evaluation

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        self._reporter.progress(state.global_step, loss=logs.get("loss"), lr=logs.get("learning_rate"))

    def on_prediction_step(self, args, state, control, **kwargs):
        self._reporter.alive(state.global_step)  # evaluating: alive, though no step ends

    def on_train_end(self, args, state, control, **kwargs):
        split = self._reporter.end(done=True)
        if split:
            print(goodput_line(split), flush=True)  # the job's split, every attempt, as the train package's last line
        rankstate.publish(step=state.global_step)
        rankstate.clear()
