"""This rank's state and heartbeat, for the chart's pod scripts: one file per rank, $DS_RANK_STATE_DIR/<pid>,
replaced atomically; nothing when the chart did not set DS_RANK_STATE_DIR (local runs, tests). The file is

    <state> [step=<n>] [step_s=<seconds>]

and its mtime is the heartbeat. Two readers in the pod (charts/deepspeed-training/files/):
- kill-ranks.sh, which stops the ranks: `starting` and `restoring` (no step finished since the rank started:
  nothing to save) are killed at once; `training` still there 10 s after SIGTERM never ran its handler (stuck
  in a C++ collective) and is killed then; `stopping` (SIGTERM reached the handler) gets the grace period.
- watchdog.py, which ends a hung attempt: a rank `starting` for longer than the start-up budget, `training`
  with no new step for longer than the step budget (or STEP_MULTIPLE x its step time, whichever is larger), or
  in one of CHECKPOINT_STATES for longer than the checkpoint budget is hung. Time in a checkpoint state does not
  count against the step budget, and `stopping` is never judged (the pod's grace period bounds it). Before it
  kills, the watchdog asks for the rank's flight recorder (the last collectives torch recorded, when the chart
  set TORCH_FR_BUFFER_SIZE: gloo and NCCL alike): it writes to the FIFO <pid>FR_REQUEST, which a thread of the
  rank waits on (blocked in the kernel, no cost), and the thread writes torch's dump to <pid>FR_DUMP. It works
  while the main thread is blocked in a collective, which releases the GIL. Then the watchdog sends
  DUMP_SIGNAL: faulthandler, registered here, writes every thread's stack to <pid>.stacks from inside the
  process (no ptrace; it also works while the rank is blocked in C++), and the report names the frame.

The contract for any program (the train package, the Hugging Face callback in train/hf_callback.py, or a
bring-your-own loop): call `beat(step)` once a step. A program that reports nothing is never judged.

Progress, for people: rank 0 also keeps DS_RANK_STATE_DIR/PROGRESS, a JSON object replaced atomically: its state,
step and step time (from report() and, every PUBLISH_EVERY_S at most, beat()), the attempt counter the pod scripts
give every rank (DS_ATTEMPT, ...), and whatever the program adds with `publish(...)` (steps, loss, tokens_per_s,
mfu, eta_s, checkpoint_step, ...). The chart's progress sidecar (files/sidecar.py) puts it into the
<release>-progress ConfigMap and serves it, with every rank's state line, as Prometheus metrics.
Why a rank ended, for the ledger: `fail(cause, line)` writes this rank's END_RECORD (the cause, one line, its last
step), which the chart's pod scripts take to the ledger's owner; an uncaught exception does it by itself (the hook is
installed at the first report(); the train package calls record_exception() from its own handler).
The protocol's words, files and signal are train/podstate.py's, which the chart's pod scripts read from their copy.
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

from train import podstate

STATES, CHECKPOINT_STATES, STEP_MULTIPLE = podstate.STATES, podstate.CHECKPOINT_STATES, podstate.STEP_MULTIPLE
DUMP_SIGNAL = podstate.DUMP_SIGNAL
FR_REQUEST, FR_DUMP = podstate.FR_REQUEST_SUFFIX, podstate.FR_DUMP_SUFFIX
LINE_BYTES = 80  # a step's line, padded: beat() rewrites it in place (one pwrite, ~1 us; a replace is ~0.3 ms)
PROGRESS = podstate.PROGRESS  # rank 0's progress, for the chart's sidecar
PUBLISH_EVERY_S = 2.0  # beat() refreshes PROGRESS at most this often (a replace is ~0.3 ms)
ATTEMPT_ENV = {key: podstate.ATTEMPT_ENV[key] for key in podstate.COUNTER_KEYS}  # the pod scripts', for every rank

_dump_file = None  # kept open for faulthandler, which writes to its descriptor from the signal handler
_last_beat: tuple[int, float] | None = None  # (step, time) of the previous beat
_step_s = 0.0  # smoothed seconds per step
_training_fd: int | None = None  # the state file, open while its state is `training`: beat() writes into it
_progress: dict = {}  # what rank 0 published so far
_next_publish = 0.0  # monotonic time after which beat() publishes again
_last_step: int | None = None  # the step of the last beat(), which publish() adds when given none
_publishing = False  # publish() is writing: a signal handler's report() in between only updates _progress


def _path() -> Path | None:
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    return Path(directory) / str(os.getpid()) if directory else None


def fail(cause: str, line: str, echo: bool = False) -> None:
    """This rank's end record (podstate.END_RECORD): why it is about to end (one of podstate.RANK_CAUSES), in one
    line, at its last step; `echo`: because another rank failed. The first one written wins (a teardown's error
    after it is a consequence). Nothing without DS_RANK_STATE_DIR; errors are ignored."""
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory:
        return
    path = Path(directory) / podstate.END_RECORD.format(rank=int(_rank()) if _rank().isdigit() else 0)
    record = podstate.end_record(os.environ.get(podstate.ATTEMPT_ENV["run"], ""), int(_rank()) if _rank().isdigit()
                                 else 0, socket.gethostname(), cause, line, _last_step, time.time(), echo)
    try:
        if path.exists() and json.loads(path.read_text()).get("run") == record["run"]:
            return
    except (OSError, ValueError, AttributeError):
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        podstate.atomic_write(path, json.dumps(record))
    except OSError:
        pass


def record_exception(error: BaseException) -> None:
    """An exception that ends this rank, as its end record: the exception's last line (`Type: message`)."""
    if isinstance(error, (SystemExit, KeyboardInterrupt)):
        return
    last = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
    line = last[-1] if last else type(error).__name__
    fail(podstate.classify_exception(type(error).__name__, str(error)), line)


def _excepthook(kind, error, tb) -> None:
    record_exception(error)
    _previous_excepthook(kind, error, tb)


_previous_excepthook = sys.excepthook


def _install_excepthook() -> None:
    """Once: a program's uncaught exception is recorded before Python prints it (chained: its own hook still runs)."""
    global _previous_excepthook
    if sys.excepthook is not _excepthook:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook


def _install_stack_dump(path: Path) -> None:
    global _dump_file
    if _dump_file is None:
        _dump_file = open(path.with_name(f"{path.name}.stacks"), "w")  # noqa: SIM115 - open for the process
        faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True)
        if os.environ.get("TORCH_FR_BUFFER_SIZE", "0") not in ("", "0"):
            request = path.with_name(f"{path.name}{FR_REQUEST}")
            request.unlink(missing_ok=True)
            os.mkfifo(request, 0o600)
            threading.Thread(target=_serve_flight_recorder, args=(request, path.with_name(f"{path.name}{FR_DUMP}")),
                             name="rankstate-flight-recorder", daemon=True).start()


def _serve_flight_recorder(request: Path, dump: Path) -> None:
    """Waits on the FIFO (open blocks until the watchdog writes); each request: torch's flight recorder, as JSON.
    Nothing is written while no process group exists (the recorder is empty then)."""
    while True:
        try:
            with open(request, "rb") as fifo:
                fifo.read()
            import torch.distributed as dist  # noqa: PLC0415 - only when asked: rankstate stays import-light
            from torch._C import _distributed_c10d  # noqa: PLC0415

            if not dist.is_initialized():
                continue
            tmp = dump.with_name(f".{dump.name}.tmp")
            tmp.write_bytes(_distributed_c10d._dump_fr_trace_json())
            os.replace(tmp, dump)
        except Exception:  # noqa: BLE001 - diagnostics must never take the rank down
            return


def report(state: str, step: int | None = None) -> None:
    """Atomically replaces this rank's state; safe in a signal handler. Errors are ignored: the state only
    shortens a shutdown or names a hang, and a rank without one gets the full grace period and no judge."""
    assert state in STATES, state
    global _last_beat, _training_fd
    if state != "training":
        _last_beat = None  # the next step's time starts after this (a save is not a slow step)
    path = _path()
    if path is None:
        return
    _check_version()
    _install_excepthook()
    fields = [state, f"rank={_rank()}", *([f"step={step}"] if step is not None else []),
              *([f"step_s={_step_s:.3f}"] if _step_s else []), f"v={podstate.VERSION}"]
    publish(state=state, step=step)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _install_stack_dump(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(" ".join(fields) + "\n")
        os.replace(tmp, path)
        if _training_fd is not None:
            os.close(_training_fd)
            _training_fd = None
        if state == "training":
            _training_fd = os.open(path, os.O_WRONLY)
    except OSError:
        pass


_version_checked = False


def _check_version() -> None:
    """Once, at the rank's first report: a chart whose pod scripts speak another protocol version would misread
    this rank (a hang missed, a stop misjudged); the rank stops at start with one line, as for a configuration
    error."""
    global _version_checked
    if _version_checked:
        return
    _version_checked = True
    try:
        podstate.check_version(os.environ.get(podstate.PROTOCOL_ENV), f"rank {_rank()}")
    except podstate.VersionSkew as err:
        print(str(err), file=sys.stderr, flush=True)
        raise SystemExit(podstate.EXIT_CONFIG_ERROR) from None


def beat(step: int) -> None:
    """One line per step for any program: this rank finished `step` (state `training`, fresh heartbeat)."""
    global _last_beat, _step_s, _last_step
    now = time.monotonic()
    _last_step = step
    if _last_beat is not None and step > _last_beat[0]:
        per_step = (now - _last_beat[1]) / (step - _last_beat[0])
        _step_s = per_step if not _step_s else 0.8 * _step_s + 0.2 * per_step
    if _training_fd is None:
        report("training", step)  # a state change: replaced atomically, so kill-ranks never reads half a word
    else:
        line = f"training rank={_rank()} step={step} step_s={_step_s:.3f} v={podstate.VERSION}".ljust(
            LINE_BYTES - 1) + "\n"
        try:
            os.pwrite(_training_fd, line.encode(), 0)  # same state word, new step: the mtime is the heartbeat
        except OSError:
            pass
        if now >= _next_publish:
            publish(state="training", step=step)
    _last_beat = (step, now)


def _rank() -> str:
    return os.environ.get("RANK", "0")


def publish(**fields) -> None:
    """Rank 0: merges `fields` (None leaves a field as it was) into PROGRESS, with the step time and the attempt
    counter, and replaces the file; other ranks, or no DS_RANK_STATE_DIR: nothing. Errors are ignored."""
    global _next_publish, _publishing
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory or _rank() != "0":
        return
    _next_publish = time.monotonic() + PUBLISH_EVERY_S
    if fields.get("step") is None:
        fields["step"] = _last_step
    _progress.update({key: value if not isinstance(value, float) or math.isfinite(value) else str(value)
                      for key, value in fields.items() if value is not None})  # a NaN loss says "nan"
    _progress.update({key: os.environ[env] for key, env in ATTEMPT_ENV.items() if env in os.environ})
    _progress.update(step_s=round(_step_s, 6), time=time.time(), v=podstate.VERSION)
    if _publishing:  # a signal handler interrupted a write: that write's next turn carries this too
        return
    _publishing = True
    path = Path(directory) / PROGRESS
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(_progress, default=str))
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - progress must never take a rank down (a program's unencodable field)
        for key in [k for k, v in _progress.items() if not _encodes(v)]:
            del _progress[key]
    finally:
        _publishing = False


def _encodes(value) -> bool:
    try:
        json.dumps(value, default=str)
        return True
    except Exception:  # noqa: BLE001
        return False


def clear() -> None:
    global _training_fd
    if _training_fd is not None:
        os.close(_training_fd)
        _training_fd = None
    path = _path()
    if path is not None:
        for leftover in (path, *(path.with_name(f"{path.name}{s}") for s in (".stacks", FR_REQUEST, FR_DUMP))):
            try:
                leftover.unlink()
            except OSError:
                pass
