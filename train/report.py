"""What a run tells people and the chart's pods (torchtitan's metrics processor is the model). Reporter is the one
reporter every program reports through, the train package and the Hugging Face callback (train/hf_callback.py)
alike: the heartbeat and state (train/rankstate.py), the job's goodput (train/goodput.py, rank 0) and the progress
rank 0 publishes (step, loss, pace, ETA, the last checkpoint). RunReport, the train package's, adds the rank-0
progress line, the straggler check, the ds_config's monitors and metrics.json.

The progress line, every log_every steps on rank 0:
`step 40/1000 | loss 3.2101 | lr 3.000e-04 | 51,234 tokens/s | 400.3 samples/s | mfu 41.0% | eta 1:02:03`.
Time the loop spends saving is kept out of the throughput figures. Stragglers names a rank that every step waits
for. The logged figures also go to rank 0's progress file (protocol.PROGRESS), for the chart's progress ConfigMap
and metrics."""

import json
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from podruntime.text import duration
from train import checkpoint, mfu, rankstate
from train.goodput import Goodput
from train.goodput import describe as goodput_line
from train.goodput import published as goodput_fields


class Reporter:
    """One rank's reports, for any program: call resumed() once its checkpoint is loaded, step_begins() before its
    first step, step() after every step, saving() and saved() around a checkpoint save, progress() whenever it logs
    figures, end() at its end. Rank 0 keeps the job's goodput records in `checkpoint_dir` (none without one) and
    publishes its progress."""

    def __init__(self, checkpoint_dir: Path | None, rank: int):
        self.checkpoint_dir, self.rank = checkpoint_dir, rank
        self.goodput: Goodput | None = None
        self.restore_started = time.perf_counter()
        self.steps: int | None = None
        self.start = (0, time.perf_counter())  # (the step it resumed at, when)
        self.mark: tuple[float, float] | None = None  # (wall, perf_counter) the next step's time counts from

    def restoring(self) -> None:
        rankstate.report("restoring")  # a long load (or a universal conversion) is not a hang
        self.restore_started = time.perf_counter()

    def resumed(self, start_step: int, steps: int | None, restore_s: float | None = None,
                rendezvous_s: float | None = None) -> None:
        """The checkpoint is loaded (at `start_step`; restore_s None: since restoring()); the start-up budget runs
        until the first step. `rendezvous_s`: the process group's set-up, where the program measured it."""
        restore = time.perf_counter() - self.restore_started if restore_s is None else restore_s
        try:
            self.goodput = Goodput(self.checkpoint_dir if self.rank == 0 else None, start_step, restore, rendezvous_s)
        except OSError:
            self.goodput = None  # accounting never stops training
        self.steps, self.start = steps, (start_step, time.perf_counter())
        rankstate.publish(steps=steps or None, checkpoint_step=start_step or None)
        rankstate.report("starting")

    def step_begins(self) -> None:
        """The first step's time counts from here (what came before it is start-up); every later one's from the end
        of the step or save before it, so that the program's own work between steps (its report, a background save's
        poll, a Trainer's batch fetch) is the steps' time, as a stopwatch sees it, not time the job's goodput leaves
        unaccounted. Later calls change nothing."""
        if self.mark is None:
            self.mark = (time.time(), time.perf_counter())

    def not_a_step(self) -> None:
        """The time since the mark was no step nor save (an evaluation): counted in neither."""
        self.mark = (time.time(), time.perf_counter())

    def _since_mark(self) -> tuple[float, float]:
        """(when the time since the mark began, wall; its seconds), the mark moved to now."""
        (started, since), now = self.mark or (time.time(), time.perf_counter()), time.perf_counter()
        self.mark = (started + now - since, now)
        return started, now - since

    def step(self, step: int, beat: bool = True) -> str | None:
        """A step ended (its time: since the mark, step_begins); `beat`: the heartbeat too (not while stopping).
        After the first step of a retry, rank 0 publishes the fault's loss by its parts and returns its line."""
        first = self.goodput is not None and self.goodput.record["first_step"] is None
        started, seconds = self._since_mark()
        if self.goodput:
            self.goodput.step(step, started, seconds)
        if beat:
            rankstate.beat(step)  # from here a SIGTERM also has something to save
        else:
            rankstate.reached(step)
        fault = self.goodput.last_fault() if first and self.rank == 0 else None
        if not fault:
            return None
        fields = goodput_fields(None, fault)
        rankstate.publish(**fields)
        return fields["fault_line"]

    def saving(self, step: int) -> None:
        rankstate.report("saving", step)  # judged by the checkpoint budget, not the step budget

    def saved(self, step: int, beat: bool = True) -> None:
        """A save at `step` ended: the time since the step before it (the save's stall and the loop's work beside it)
        is the save's; the next step's budget starts now."""
        stall = self._since_mark()[1]
        if self.goodput:
            self.goodput.saved(step, stall)
        if beat:
            rankstate.beat(step)

    def alive(self, step: int) -> None:
        """Busy with no step ending (an evaluation): not a hang."""
        rankstate.report("training", step)

    def eta(self, step: int) -> float | None:
        """Seconds left at the pace since the resume."""
        done = step - self.start[0]
        if not self.steps or done <= 0:
            return None
        return round((time.perf_counter() - self.start[1]) / done * (self.steps - step), 1)

    def progress(self, step: int, **figures) -> float | None:
        """Rank 0's figures of `step` (loss, lr, tokens_per_s, ...), published with the ETA and the job's goodput;
        the ETA."""
        eta_s = self.eta(step)
        split = self.goodput.job() if self.goodput and self.rank == 0 else None
        rankstate.publish(step=step, steps=self.steps, eta_s=eta_s, **figures, **goodput_fields(split))
        return eta_s

    def end(self, done: bool) -> dict | None:
        """The job's goodput split (rank 0; None elsewhere), published with the end."""
        split = None
        if self.goodput:
            self.goodput.flush()
            split = self.goodput.job() if self.rank == 0 else None
        rankstate.publish(**goodput_fields(split), **({"state": "done", "eta_s": 0} if done else {}))
        return split


class Progress:
    """The rank-0 progress line and the interval timing behind it."""

    def __init__(self, logger, reporter: Reporter, log_every: int, tokens_per_step: int, global_batch: int,
                 mfu_of: Callable[[float], float | None]):
        self.logger, self.reporter, self.log_every = logger, reporter, log_every
        self.steps, self.start_step = reporter.steps, reporter.start[0]
        self.tokens_per_step, self.global_batch, self.mfu_of = tokens_per_step, global_batch, mfu_of
        self.started = self.interval_start = time.perf_counter()
        self.last_logged = self.start_step
        self.paused_s = 0.0

    def step(self, step: int, loss: float, lr: float, force: bool = False) -> bool:
        """Logs the line every log_every steps, at the last step, and when `force`d (a stop); whether it did."""
        if not (step % self.log_every == 0 or step == self.steps or force):
            return False
        now = time.perf_counter()
        interval_steps, self.last_logged = step - self.last_logged, step
        interval = now - self.interval_start
        tokens_per_s = self.tokens_per_step * interval_steps / interval
        utilised = self.mfu_of(tokens_per_s)
        eta_s = self.reporter.progress(step, loss=loss, lr=lr, tokens_per_s=round(tokens_per_s, 1), mfu=utilised)
        self.logger.info(
            f"step {step}/{self.steps} | loss {loss:.4f} | lr {lr:.3e} | {tokens_per_s:,.0f} tokens/s | "
            f"{self.global_batch * interval_steps / interval:.1f} samples/s | "
            f"{'' if utilised is None else f'mfu {utilised:.1%} | '}eta {duration(eta_s or 0, 'clock')}")
        self.interval_start = now
        return True

    def pause(self, seconds: float) -> None:
        """`seconds` spent outside training (a checkpoint save): left out of tokens/s."""
        self.paused_s += seconds
        self.interval_start += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class Stragglers:
    """Names a rank whose own compute time per step (until the step's first collective, which every other rank enters
    first and waits in: the wall-clock step time is the same on every rank of a synchronous job) is over RATIO x
    the median of all ranks for RUN consecutive steps: one warning per rank at most every QUIET_S seconds, with
    its host and its time against the median."""

    RATIO, RUN, QUIET_S = 1.2, 10, 60.0

    def __init__(self, logger, hosts: list[str]):
        self.logger, self.hosts = logger, hosts
        self.recent: list[list[tuple[float, float]]] = [[] for _ in hosts]  # (own, median) of the current run
        self.named_at: dict[int, float] = {}

    def step(self, compute: list[float]) -> None:
        median = statistics.median(compute)
        if median <= 0:  # not measured (a pipeline)
            return
        now = time.monotonic()
        for rank, own in enumerate(compute):
            run = self.recent[rank]
            if own <= self.RATIO * median:
                run.clear()
                continue
            run.append((own, median))
            del run[:-self.RUN]
            if len(run) == self.RUN and now - self.named_at.get(rank, -self.QUIET_S) >= self.QUIET_S:
                self.named_at[rank] = now
                own_mean, median_mean = (statistics.fmean(x) for x in zip(*run, strict=True))
                self.logger.warning(
                    f"straggler: rank {rank} ({self.hosts[rank]}) took {own_mean * 1000:,.0f} ms of its own compute "
                    f"per step against a median of {median_mean * 1000:,.0f} ms ({own_mean / median_mean:.1f}x) for "
                    f"the last {self.RUN} steps: every rank waits for it")


@dataclass
class Utilisation:
    """What the MFU needs: the model's training FLOPs per token and one accelerator's peak (None: unknown)."""
    flops_per_token: int
    peak_tflops: float | None

    def of(self, tokens_per_s: float, world_size: int) -> float | None:
        return mfu.mfu(tokens_per_s / world_size, self.flops_per_token, self.peak_tflops)


@dataclass
class Run:
    """What the report needs to know of the run it reports."""
    rank: int
    world_size: int
    steps: int
    log_every: int
    global_batch: int
    tokens_per_step: int
    checkpoint_dir: Path | None
    hosts: list[str]  # every rank's host, by rank
    use: Utilisation
    rendezvous_s: float | None = None  # deepspeed.init_distributed's time


class RunReport:
    """The heartbeat, goodput, progress line, straggler check, monitors and metrics.json of one attempt."""

    def __init__(self, logger, run: Run):
        self.logger, self.run = logger, run
        self.losses: list[tuple[int, float]] = []
        self.reporter = Reporter(run.checkpoint_dir, run.rank)
        self.progress: Progress | None = None
        self.stragglers = Stragglers(logger, run.hosts)

    def restoring(self) -> None:
        self.reporter.restoring()

    def resumed(self, start_step: int) -> None:
        run = self.run
        self.reporter.resumed(start_step, run.steps, rendezvous_s=run.rendezvous_s)
        if start_step >= run.steps:
            self.logger.info(f"nothing to do: already at step {start_step} of {run.steps}")
        self.progress = Progress(self.logger, self.reporter, run.log_every, run.tokens_per_step, run.global_batch,
                                 lambda tokens_per_s: run.use.of(tokens_per_s, run.world_size))

    def step_begins(self) -> None:
        self.reporter.step_begins()  # the first step's own start; later steps count from the one before

    def step(self, step: int, loss: float, lr: float, compute: list[float], stopping: bool, engine) -> None:
        """A finished step: its loss (the mean over ranks), every rank's own compute time, whether the ranks stop."""
        fault = self.reporter.step(step, beat=not stopping)
        if fault:
            self.logger.info(fault)
        self.losses.append((step, loss))
        if self.run.rank == 0:
            self.stragglers.step(compute)
            if engine.monitor.enabled:  # ds_config's tensorboard / csv_monitor / wandb sections
                engine.monitor.write_events([("Train/Samples/train_loss", loss, engine.global_samples)])
        self.progress.step(step, loss, lr, force=stopping)

    def saved(self, step: int, tag_dir, stall: float, stopping: bool) -> None:
        """A save at `step`: the step loop waited `stall` seconds (all of it, unless it is written in the
        background, which committed() reports)."""
        self.progress.pause(stall)
        rankstate.publish(checkpoint_save_s=round(stall, 3))
        self.reporter.saved(step, beat=not stopping)

    def committed(self, committed: dict) -> None:
        """A checkpoint every rank can resume from: its commit record is written."""
        tag, write_s, size = checkpoint.tag_for(committed["step"]), committed["write_s"], committed["bytes"]
        if committed["stall_s"] is None:  # written in the step loop
            self.logger.info(f"saved checkpoint {tag} in {write_s:.1f}s")
        else:
            self.logger.info(f"saved checkpoint {tag} in {write_s:.1f}s in the background ({size / 1e6:,.1f} MB on "
                             f"this rank, {size / 1e6 / max(write_s, 1e-6):,.0f} MB/s; the steps waited "
                             f"{committed['stall_s']:.2f}s)")
        rankstate.publish(checkpoint_step=committed["step"], checkpoint_write_s=round(write_s, 3))

    def end(self, status: int) -> None:
        """After the last step (or the stop): metrics.json, the done line and the job's goodput; on every rank."""
        import deepspeed.comm as dist  # noqa: PLC0415 - a collective: every rank's peak memory

        elapsed = self.progress.elapsed()
        peak_rss = [0.0] * self.run.world_size  # MiB per rank
        dist.all_gather_object(peak_rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        split = self.reporter.end(status == 0) or {}
        if self.losses:  # a run with nothing left to do keeps the last metrics
            if self.run.rank == 0 and self.run.checkpoint_dir:
                self.write_metrics(elapsed, peak_rss, split)
            self.logger.info(f"done: {len(self.losses)} steps in {elapsed:.1f}s, final loss {self.losses[-1][1]:.4f}")
            if split:  # rank 0
                self.logger.info(goodput_line(split) if status == 0 else f"so far: {goodput_line(split)}")

    def write_metrics(self, elapsed: float, peak_rss: list[float], goodput: dict) -> None:
        run, checkpoint_s = self.run, self.progress.paused_s
        tokens_per_s = run.tokens_per_step * len(self.losses) / (elapsed - checkpoint_s)  # saves left out
        metrics = {
            "steps": self.losses[-1][0],
            "steps_run": len(self.losses),
            "final_loss": self.losses[-1][1],
            "tokens_per_s": tokens_per_s,
            "model_flops_per_token": run.use.flops_per_token,
            "peak_tflops": run.use.peak_tflops,
            "mfu": run.use.of(tokens_per_s, run.world_size),
            "elapsed_s": elapsed,
            "checkpoint_s": checkpoint_s,
            "world_size": run.world_size,
            "peak_rss_mib": peak_rss,
            "goodput_s": goodput,  # the whole job, every attempt (train/goodput.py)
            "losses": self.losses,
        }
        checkpoint.write_atomic(run.checkpoint_dir / "metrics.json", json.dumps(metrics, indent=1))
