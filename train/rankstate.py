"""This rank's state and heartbeat, for the chart's pod programs (podruntime): one file per rank,
$DS_RANK_STATE_DIR/<pid>, replaced atomically; nothing when the chart did not set DS_RANK_STATE_DIR (local runs,
tests). The file is

    <state> rank=<r> [step=<n>] [step_s=<seconds>] v=<protocol version>

and its mtime is the heartbeat. Its readers in the pod (the protocol's table, podruntime/protocol.py):
- the rank stopper (podruntime/ranks.py): `starting` and `restoring` (no step finished since the rank started:
  nothing to save) are killed at once; `training` still there 10 s after SIGTERM never ran its handler (stuck in a
  C++ collective) and is killed then; `stopping` (SIGTERM reached the handler) gets the grace period.
- the watchdog (podruntime/watchdog.py), which ends a hung attempt: a rank `starting` for longer than the start-up
  budget, `training` with no new step for longer than the step budget (or STEP_MULTIPLE x its step time), or in a
  checkpoint state for longer than the checkpoint budget. Before it kills, it asks the rank for its stacks and
  torch's flight recorder through the FIFO <pid>.diag, which the rank's diagnostics thread reads (blocked in the
  kernel, no cost): the thread answers holding the GIL, so no other thread of the rank runs Python while its frames
  are read (faulthandler's dump from a signal handler, registered too, can read a thread's frames while they change;
  the watchdog sends that signal only to a rank whose thread cannot answer). It works while the main thread is
  blocked in a C++ collective, which releases the GIL.

The contract for any program (the train package, the Hugging Face callback in train/hf_callback.py, or a
bring-your-own loop): call `beat(step)` once a step. A program that reports nothing is never judged.

Progress, for people: rank 0 also keeps DS_RANK_STATE_DIR/PROGRESS, a JSON object replaced atomically: its state,
step and step time (from report() and, every PUBLISH_EVERY_S at most, beat()), the attempt counter the ledger gives
every rank (DS_ATTEMPT, ...), and whatever the program adds with `publish(...)` (steps, loss, tokens_per_s, mfu,
eta_s, checkpoint_step, ...), which the chart's progress sidecar publishes. Why a rank ended, for the ledger:
`fail(cause, line)` writes this rank's END_RECORD; an uncaught exception does it by itself (the hook is installed
at the first report(); the train package calls record_exception() from its own handler).
"""

import faulthandler
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from podruntime import protocol

STATES, CHECKPOINT_STATES = protocol.STATES, protocol.CHECKPOINT_STATES
LINE_BYTES = 80  # a step's line, padded: beat() rewrites it in place (one pwrite, ~1 us; a replace is ~0.3 ms)
PROGRESS = protocol.PROGRESS  # rank 0's progress, for the chart's sidecar
PUBLISH_EVERY_S = 2.0  # beat() refreshes PROGRESS at most this often (a replace is ~0.3 ms)
ATTEMPT_ENV = {key: protocol.ATTEMPT_ENV[key] for key in protocol.COUNTER_KEYS}  # the ledger's, for every rank


def _rank() -> str:
    return os.environ.get("RANK", "0")


class RankState:
    """Everything this rank reports, in one place: one object per process (`STATE`)."""

    def __init__(self):
        self.dump_file = None  # kept open: faulthandler and the diagnostics thread write to its descriptor
        self.last_beat: tuple[int, float] | None = None  # (step, time) of the previous beat
        self.step_s = 0.0  # smoothed seconds per step
        self.training_fd: int | None = None  # the state file, open while its state is `training`: beat() writes it
        self.progress: dict = {}  # what rank 0 published so far
        self.next_publish = 0.0  # monotonic time after which beat() publishes again
        self.last_step: int | None = None  # the step of the last beat(), which publish() adds when given none
        self.publishing = False  # publish() is writing: a signal handler's report() in between only updates progress
        self.version_checked = False
        self.previous_excepthook = sys.excepthook
        self.hooked = False

    @staticmethod
    def path() -> Path | None:
        directory = os.environ.get(protocol.STATE_DIR_ENV)
        return Path(directory) / str(os.getpid()) if directory else None

    # ---- the end record

    def fail(self, cause: str, line: str, echo: bool = False) -> None:
        directory = os.environ.get(protocol.STATE_DIR_ENV)
        if not directory:
            return
        rank = int(_rank()) if _rank().isdigit() else 0
        path = Path(directory) / protocol.END_RECORD.format(rank=rank)
        record = protocol.end_record(os.environ.get(protocol.ATTEMPT_ENV["run"], ""), rank, socket.gethostname(),
                                     cause, line, self.last_step, time.time(), echo)
        try:
            if path.exists() and json.loads(path.read_text()).get("run") == record["run"]:
                return
        except (OSError, ValueError, AttributeError):
            pass
        _replace(path, json.dumps(record))

    def excepthook(self, kind, error, tb) -> None:
        record_exception(error)
        self.previous_excepthook(kind, error, tb)

    def install_excepthook(self) -> None:
        """Once: a program's uncaught exception is recorded before Python prints it (chained: its own hook still
        runs). Never again: a hook installed later (torch.distributed's) chains to this one, and wrapping it in
        turn would make the two call each other forever."""
        if not self.hooked:
            self.hooked = True
            self.previous_excepthook = sys.excepthook
            sys.excepthook = self.excepthook

    # ---- the diagnostics the watchdog asks for

    def install_diagnostics(self, path: Path) -> None:
        if self.dump_file is not None:
            return
        self.dump_file = open(path.with_name(f"{path.name}{protocol.STACKS_SUFFIX}"), "w")  # noqa: SIM115
        faulthandler.register(protocol.DUMP_SIGNAL, file=self.dump_file, all_threads=True)  # the fallback
        request = path.with_name(f"{path.name}{protocol.DIAG_REQUEST_SUFFIX}")
        request.unlink(missing_ok=True)
        os.mkfifo(request, 0o600)
        threading.Thread(target=self.serve_diagnostics, args=(request, path), name="rankstate-diagnostics",
                         daemon=True).start()

    def serve_diagnostics(self, request: Path, path: Path) -> None:
        """Waits on the FIFO (open blocks until the watchdog writes); each request byte: DIAG_STACKS, every thread's
        stack, from this thread with the GIL held (no other thread runs Python meanwhile); DIAG_FLIGHT_RECORDER,
        torch's flight recorder as JSON (nothing while no process group exists, or without TORCH_FR_BUFFER_SIZE)."""
        while True:
            try:
                with open(request, "rb") as fifo:
                    asked = fifo.read()
                if protocol.DIAG_STACKS in asked:
                    faulthandler.dump_traceback(file=self.dump_file, all_threads=True)
                    self.dump_file.flush()
                if protocol.DIAG_FLIGHT_RECORDER in asked:
                    dump_flight_recorder(path.with_name(f"{path.name}{protocol.FR_DUMP_SUFFIX}"))
            except Exception:  # noqa: BLE001 - diagnostics must never take the rank down
                return

    # ---- the state line and the heartbeat

    def report(self, state: str, step: int | None = None) -> None:
        assert state in STATES, state
        if state != "training":
            self.last_beat = None  # the next step's time starts after this (a save is not a slow step)
        path = self.path()
        if path is None:
            return
        self.check_version()
        self.install_excepthook()
        fields = [state, f"rank={_rank()}", *([f"step={step}"] if step is not None else []),
                  *([f"step_s={self.step_s:.3f}"] if self.step_s else []), f"v={protocol.VERSION}"]
        self.publish(state=state, step=step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.install_diagnostics(path)
            _replace(path, " ".join(fields) + "\n")
            if self.training_fd is not None:
                os.close(self.training_fd)
                self.training_fd = None
            if state == "training":
                self.training_fd = os.open(path, os.O_WRONLY)
        except OSError:
            pass

    def check_version(self) -> None:
        """Once, at the rank's first report: a chart whose pod programs speak another protocol version would misread
        this rank (a hang missed, a stop misjudged); the rank stops at start with one line, as for a configuration
        error."""
        if self.version_checked:
            return
        self.version_checked = True
        try:
            protocol.check_version(os.environ.get(protocol.PROTOCOL_ENV), f"rank {_rank()}")
        except protocol.VersionSkew as err:
            print(str(err), file=sys.stderr, flush=True)
            raise SystemExit(protocol.EXIT_CONFIG_ERROR) from None

    def reached(self, step: int) -> None:
        self.last_step = max(step, self.last_step or 0)

    def beat(self, step: int) -> None:
        now = time.monotonic()
        self.last_step = step
        if self.last_beat is not None and step > self.last_beat[0]:
            per_step = (now - self.last_beat[1]) / (step - self.last_beat[0])
            self.step_s = per_step if not self.step_s else 0.8 * self.step_s + 0.2 * per_step
        fd = self.training_fd  # read once: a SIGTERM handler may report another state (and close it) at any point
        if fd is None:
            self.report("training", step)  # a state change: replaced atomically, so no reader sees half a word
        else:
            line = f"training rank={_rank()} step={step} step_s={self.step_s:.3f} v={protocol.VERSION}".ljust(
                LINE_BYTES - 1) + "\n"
            try:
                os.pwrite(fd, line.encode(), 0)  # same state word, new step: the mtime is the heartbeat
            except OSError:
                pass  # closed meanwhile by the handler's report: the state it wrote stands
            if now >= self.next_publish and self.training_fd == fd:
                self.publish(state="training", step=step)
        self.last_beat = (step, now)

    # ---- rank 0's progress

    def publish(self, **fields) -> None:
        directory = os.environ.get(protocol.STATE_DIR_ENV)
        if not directory or _rank() != "0":
            return
        self.next_publish = time.monotonic() + PUBLISH_EVERY_S
        if fields.get("step") is None:
            fields["step"] = self.last_step
        self.progress.update({key: value if not isinstance(value, float) or math.isfinite(value) else str(value)
                              for key, value in fields.items() if value is not None})  # a NaN loss says "nan"
        self.progress.update({key: os.environ[env] for key, env in ATTEMPT_ENV.items() if env in os.environ})
        self.progress.update(step_s=round(self.step_s, 6), time=time.time(), v=protocol.VERSION)
        if self.publishing:  # a signal handler interrupted a write: that write's next turn carries this too
            return
        self.publishing = True
        try:
            _replace(Path(directory) / PROGRESS, json.dumps(self.progress, default=str))
        except Exception:  # noqa: BLE001 - progress must never take a rank down (a program's unencodable field)
            for key in [k for k, v in self.progress.items() if not _encodes(v)]:
                del self.progress[key]
        finally:
            self.publishing = False

    def clear(self) -> None:
        if self.training_fd is not None:
            os.close(self.training_fd)
            self.training_fd = None
        path = self.path()
        if path is not None:
            for leftover in (path, *(path.with_name(f"{path.name}{s}") for s in protocol.RANK_SUFFIXES)):
                try:
                    leftover.unlink()
                except OSError:
                    pass


def dump_flight_recorder(dump: Path) -> None:
    """torch's flight recorder as JSON into `dump` (replaced whole), when a process group exists. A program that has
    not imported torch.distributed has none: nothing is imported here (an import is Python running in this thread
    for seconds, while the watchdog may be reading the rank's threads)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized() or os.environ.get("TORCH_FR_BUFFER_SIZE", "0") in ("", "0"):
        return
    from torch._C import _distributed_c10d  # noqa: PLC0415

    _replace(dump, _distributed_c10d._dump_fr_trace_json(), binary=True)


def _replace(path: Path, data, binary: bool = False) -> None:
    """`path` replaced whole (a reader sees the old file or the new one); OSError for the caller."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if binary:
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


def _encodes(value) -> bool:
    try:
        json.dumps(value, default=str)
        return True
    except Exception:  # noqa: BLE001
        return False


STATE = RankState()


def fail(cause: str, line: str, echo: bool = False) -> None:
    """This rank's end record (protocol.END_RECORD): why it is about to end (one of protocol.RANK_CAUSES), in one
    line, at its last step; `echo`: because another rank failed. The first one written wins (a teardown's error
    after it is a consequence). Nothing without DS_RANK_STATE_DIR; errors are ignored."""
    try:
        STATE.fail(cause, line, echo)
    except OSError:
        pass


def record_exception(error: BaseException) -> None:
    """An exception that ends this rank, as its end record: the exception's last line (`Type: message`)."""
    if isinstance(error, (SystemExit, KeyboardInterrupt)):
        return
    last = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
    fail(protocol.classify_exception(type(error).__name__, str(error)), last[-1] if last else type(error).__name__)


def report(state: str, step: int | None = None) -> None:
    """Atomically replaces this rank's state; safe in a signal handler. Errors are ignored: the state only shortens
    a shutdown or names a hang, and a rank without one gets the full grace period and no judge."""
    STATE.report(state, step)


def beat(step: int) -> None:
    """One line per step for any program: this rank finished `step` (state `training`, fresh heartbeat)."""
    STATE.beat(step)


def reached(step: int) -> None:
    """This rank finished `step` while it stops: the step its progress and its end say, with no heartbeat (its
    state stays `stopping`, which no watchdog judges)."""
    STATE.reached(step)


def publish(**fields) -> None:
    """Rank 0: merges `fields` (None leaves a field as it was) into PROGRESS, with the step time and the attempt
    counter, and replaces the file; other ranks, or no DS_RANK_STATE_DIR: nothing. Errors are ignored."""
    STATE.publish(**fields)


def clear() -> None:
    STATE.clear()
