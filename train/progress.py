"""The rank-0 progress line and the interval timing behind it, in one object the training loop calls once a step:
`step 40/1000 | loss 3.2101 | lr 3.000e-04 | 51,234 tokens/s | 400.3 samples/s | mfu 41.0% | eta 1:02:03`.
Time the loop reports as paused (checkpoint saves) is kept out of the throughput figures. Stragglers names a rank
that every step waits for. The logged figures also go to rank 0's progress file (train/rankstate.py), for the chart's
progress ConfigMap and metrics."""

import statistics
import time
from collections.abc import Callable

from train import rankstate


def format_eta(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    def __init__(self, logger, steps: int, start_step: int, log_every: int, tokens_per_step: int, global_batch: int,
                 mfu_of: Callable[[float], float | None]):
        self.logger, self.steps, self.start_step, self.log_every = logger, steps, start_step, log_every
        self.tokens_per_step, self.global_batch, self.mfu_of = tokens_per_step, global_batch, mfu_of
        self.started = self.interval_start = time.perf_counter()
        self.last_logged = start_step
        self.paused_s = 0.0

    def step(self, step: int, loss: float, lr: float, force: bool = False) -> bool:
        """Logs the line every log_every steps, at the last step, and when `force`d (a stop); whether it did."""
        if not (step % self.log_every == 0 or step == self.steps or force):
            return False
        now = time.perf_counter()
        interval_steps, self.last_logged = step - self.last_logged, step
        interval = now - self.interval_start
        per_step = (now - self.started) / (step - self.start_step)
        tokens_per_s = self.tokens_per_step * interval_steps / interval
        utilised = self.mfu_of(tokens_per_s)
        eta_s = per_step * (self.steps - step)
        rankstate.publish(step=step, steps=self.steps, loss=loss, lr=lr, tokens_per_s=round(tokens_per_s, 1),
                          mfu=utilised, eta_s=round(eta_s, 1))
        self.logger.info(
            f"step {step}/{self.steps} | loss {loss:.4f} | lr {lr:.3e} | {tokens_per_s:,.0f} tokens/s | "
            f"{self.global_batch * interval_steps / interval:.1f} samples/s | "
            f"{'' if utilised is None else f'mfu {utilised:.1%} | '}eta {format_eta(eta_s)}")
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
