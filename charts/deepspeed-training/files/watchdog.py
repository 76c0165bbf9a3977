"""Hang detection for the ranks of this pod, in both launch modes; no operator, nothing outside the pod.

Every rank that reports progress keeps a state file, DS_RANK_STATE_DIR/<pid> (train/rankstate.py: `<state>
[step=N] [step_s=S]`, its mtime the heartbeat). A rank is hung when its file has not changed for longer than
its budget: DS_HANG_STARTUP_SECONDS while `starting` (from its first report to its first step), while
`training` DS_HANG_STEP_SECONDS or STEP_MULTIPLE x its own recent step time, whichever is larger, and
DS_HANG_CHECKPOINT_SECONDS while `restoring` or `saving` (a rank stopped in the middle of a save hangs its peers
there too). Time in those two does not count against the step budget; `stopping` is never judged (the pod's
grace period bounds it), and a program that reports nothing is never judged.

On a hang, before anything is killed, every rank of this pod is asked for its stacks (DUMP_SIGNAL: faulthandler,
registered inside the rank, writes <pid>.stacks; no ptrace needed) and for torch's flight recorder, the last
collectives it recorded (a write to the FIFO <pid>FR_REQUEST, which a thread of the rank answers with
<pid>FR_DUMP: gloo and NCCL alike, when the chart set TORCH_FR_BUFFER_SIZE). The report says, per rank, whether it
waits in a collective (then it waits for a peer) or where else it is (the likely culprit), or that the process
is stopped and cannot answer. It goes to this pod's log, to the state directory's hang-<run>.txt (the launcher or
the worker script prints it after the failed run) and hang-<run>.json (podstate.hang_report: how each rank was found
and its last beat; the ledger's owner merges every host's into the job's verdict, naming the culprit) and, with every
stack, to DS_CHECKPOINT_DIR/_job/diagnostics/<run>/<host>.txt (the last podstate.KEEP_RUNS runs'). Then the ranks
get SIGKILL: DeepSpeed's launcher fails the run, and the launcher (ssh) or the workers (nossh) start it again from
the last complete checkpoint, like a crash.
The peers on other pods stop progressing too, so their watchdogs report and end them the same way.

The protocol (states, the budgets' multiple, the dump signal, file names) is train/podstate.py's, from the
chart's copy.

Usage: watchdog.py   (runs until its parent exits; standard library and the protocol's copy)
"""

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "generated"))  # the chart's copy of train/podstate.py
import podstate  # noqa: E402

STATES, CHECKPOINT_STATES, STEP_MULTIPLE = podstate.STATES, podstate.CHECKPOINT_STATES, podstate.STEP_MULTIPLE
DUMP_SIGNAL, FR_REQUEST, FR_DUMP = podstate.DUMP_SIGNAL, podstate.FR_REQUEST_SUFFIX, podstate.FR_DUMP_SUFFIX

POLL_S = 1.0
DUMP_WAIT_S = 3.0
COLLECTIVE_PATHS = ("torch/distributed/", "deepspeed/comm/", "deepspeed/runtime/pipe/p2p")
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def log(message: str) -> None:
    print(f"watchdog: {socket.gethostname()}: {message}", flush=True)


class Rank:
    """What the watchdog knows of one rank process."""

    def __init__(self, pid: int):
        self.pid, self.uncounted_until = pid, 0.0
        self.state, self.step, self.step_s, self.mtime = "starting", None, 0.0, time.time()
        self.env = read_environ(pid)

    def refresh(self, path: Path, now: float) -> bool:
        """Re-reads the state file; False when it is gone."""
        try:
            state, fields = podstate.rank_line(path.read_text())
            self.mtime = path.stat().st_mtime
        except OSError:
            return False
        self.state = state or "training"  # a bare touch is a heartbeat
        self.step = int(fields["step"]) if fields.get("step", "").isdigit() else self.step
        try:
            self.step_s = float(fields.get("step_s", 0))
        except ValueError:
            self.step_s = 0.0
        if not 0 <= self.step_s < 86400:  # nan, inf or nonsense from a program's own writer: the plain budget
            self.step_s = 0.0
        if self.state in CHECKPOINT_STATES:
            self.uncounted_until = now
        return True

    def budget(self, budgets: dict[str, float]) -> float:
        if self.state == "training":
            return max(budgets["training"], STEP_MULTIPLE * self.step_s)
        return budgets["checkpoint" if self.state in CHECKPOINT_STATES else self.state]

    def quiet_for(self, now: float, wall_now: float) -> float:
        """Seconds without progress: since the last report (the first one, for a rank still starting; the
        start of the save or restore, for one in a checkpoint state), or, training, since the end of the last
        checkpoint state."""
        if self.state in CHECKPOINT_STATES:
            return wall_now - self.mtime
        return min(wall_now - self.mtime, now - self.uncounted_until)

    def name(self) -> str:
        return f"rank {self.env.get('RANK', '?')} (pid {self.pid}, local rank {self.env.get('LOCAL_RANK', '?')})"


def read_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def process_state(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(None, 1)[1]
    except OSError:
        pass
    return "gone"


def main_thread(stacks: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread, innermost first: the thread whose oldest frame is not
    threading's bootstrap (faulthandler prints threads most recent call first)."""
    threads = [[m for m in map(FRAME.match, block.splitlines()) if m]
               for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)]
    threads = [t for t in threads if t]
    main = [t for t in threads if not t[-1]["file"].endswith("threading.py")] or threads
    return [(m["file"], int(m["line"]), m["func"]) for m in main[-1]] if main else []


def describe(frames: list[tuple[str, int, str]]) -> tuple[bool, str]:
    """(waits in a collective, where): the innermost collective call, or the innermost frame of the program."""
    for file, line, func in frames:
        if any(part in file for part in COLLECTIVE_PATHS):
            caller = next((f"{Path(f).name}:{n} in {fn}" for f, n, fn in frames
                           if not any(p in f for p in COLLECTIVE_PATHS) and "site-packages/deepspeed" not in f),
                          "")
            return True, f"waits in a collective: {func} ({file}:{line})" + (f", called from {caller}" if caller
                                                                                else "")
    file, line, func = frames[0]
    return False, f"in {func} ({file}:{line}), not in a collective"


def dump_stacks(ranks: list[Rank], state_dir: Path) -> dict[int, str]:
    """Asks every rank for its stacks and waits up to DUMP_WAIT_S for each answer ("" when none came)."""
    sizes = {}
    for rank in ranks:
        path = state_dir / f"{rank.pid}.stacks"
        sizes[rank.pid] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(rank.pid, DUMP_SIGNAL)
        except OSError:
            pass
    deadline = time.monotonic() + DUMP_WAIT_S
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline and len(stacks) < len(ranks):
        time.sleep(0.2)
        for rank in ranks:
            path = state_dir / f"{rank.pid}.stacks"
            if rank.pid not in stacks and path.exists() and path.stat().st_size > sizes[rank.pid]:
                time.sleep(0.2)  # let the handler finish writing
                stacks[rank.pid] = path.read_text(errors="replace")[sizes[rank.pid]:]
    return stacks


def dump_flight_recorders(ranks: list[Rank], state_dir: Path) -> dict[int, dict]:
    """Asks every rank that serves its flight recorder for a dump and waits up to DUMP_WAIT_S: {pid: dump}."""
    asked = {}
    for rank in ranks:
        (state_dir / f"{rank.pid}{FR_DUMP}").unlink(missing_ok=True)
        try:  # O_NONBLOCK: ENXIO at once when no thread listens (a stopped rank, a program without the recorder)
            fd = os.open(state_dir / f"{rank.pid}{FR_REQUEST}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        os.write(fd, b"1")
        os.close(fd)
        asked[rank.pid] = state_dir / f"{rank.pid}{FR_DUMP}"
    dumps: dict[int, dict] = {}
    deadline = time.monotonic() + DUMP_WAIT_S
    while asked and time.monotonic() < deadline:
        time.sleep(0.2)
        for pid, path in list(asked.items()):
            try:
                dumps[pid] = json.loads(path.read_text())
                del asked[pid]
            except (OSError, ValueError):
                pass
    return dumps


def last_collective(dump: dict) -> str:
    """Where the rank's collectives stand: the oldest one still pending (it waits there for a peer), else the
    newest completed (a rank whose collectives all completed never reached the one its peers wait in). Sequence
    numbers count per process group, so the group is named; record_id orders entries across groups. Gloo
    records no start or end events: its entries say `scheduled` until retired."""
    entries = [e for e in dump.get("entries", []) if not e.get("is_p2p")]
    if not entries:
        return "no collective recorded"
    pending = [e for e in entries if not e.get("retired")]
    entry = (min(pending, key=lambda e: e.get("record_id", 0)) if pending
             else max(entries, key=lambda e: e.get("record_id", 0)))
    group = (entry.get("process_group") or ["?", "?"])[-1]
    state = f"pending, {entry.get('state', '?')}" if pending else "completed"
    return (f"last recorded collective #{entry.get('collective_seq_id')} {entry.get('profiling_name', '?')} in "
            f"group {group} ({state})")


def report(hung: list[tuple[Rank, float, float]], ranks: list[Rank], state_dir: Path) -> None:
    host = socket.gethostname()
    recorders = dump_flight_recorders(ranks, state_dir)
    stacks = dump_stacks(ranks, state_dir)
    run = re.sub(r"[^A-Za-z0-9_.-]", "_", next((r.env["DS_RUN_ID"] for r in ranks if r.env.get("DS_RUN_ID")), "run"))
    found = []  # podstate.hang_rank of every rank: what the ledger's owner merges
    lines = [f"hang on {host} ({run}): " + "; ".join(
        f"{rank.name()} made no progress for {quiet:.0f}s (budget {budget:.0f}s, {rank.state}"
        + (f" after step {rank.step}" if rank.step is not None else "") + ")" for rank, quiet, budget in hung)]
    for rank in ranks:
        proc = process_state(rank.pid)
        frames = main_thread(stacks.get(rank.pid, ""))
        if proc.startswith("T"):
            kind, where = "stopped", f"process stopped ({proc})"
            verdict = f"{where}: it cannot run, nor answer for its stack; likely the culprit"
        elif frames:
            waits, where = describe(frames)
            kind = "in-collective" if waits else "outside-collective"
            verdict = where + ("" if waits else "; likely the culprit: its peers wait for it")
        else:
            kind, where = "unresponsive", f"no stack (process {proc})"
            verdict = f"{where}; the program did not register train.rankstate's stack dump"
        if rank.pid in recorders:
            verdict += f"; {last_collective(recorders[rank.pid])}"
        lines.append(f"  {rank.name()} on {host}: {verdict}")
        found.append(podstate.hang_rank(rank.env.get("RANK", -1), host, kind, rank.mtime, rank.step, rank.state,
                                        where))
    text = "\n".join(lines)
    for line in lines:
        log(line.strip())
    (state_dir / podstate.HANG_TEXT.format(run=run)).write_text(text + "\n")
    podstate.atomic_write(state_dir / podstate.HANG_JSON.format(run=run),
                          json.dumps(podstate.hang_report(host, run, time.time(), found)) + "\n")
    checkpoints = os.environ.get("DS_CHECKPOINT_DIR", "")
    if checkpoints and os.access(checkpoints, os.W_OK):
        folder = podstate.job_path(Path(checkpoints), podstate.DIAGNOSTICS) / run
        try:
            folder.mkdir(parents=True, exist_ok=True)
            full = "\n\n".join(f"===== {r.name()}: stacks\n{stacks.get(r.pid, '(none)')}" for r in ranks)
            (folder / f"{host}.txt").write_text(f"{text}\n\n{full}\n")
            for rank in ranks:
                if rank.pid in recorders:
                    (folder / f"{host}-rank{rank.env.get('RANK', rank.pid)}{FR_DUMP}").write_text(
                        json.dumps(recorders[rank.pid]))
            podstate.prune(folder.parent, podstate.KEEP_RUNS, spare=run)
            log(f"stacks of every rank here: {folder / host}.txt"
                + (f"; flight recorders: {folder / host}-rank<N>{FR_DUMP}" if recorders else ""))
        except OSError as err:
            log(f"could not write {folder}: {err.strerror}")


def main() -> int:
    state_dir = Path(os.environ[podstate.STATE_DIR_ENV])
    budgets = {"starting": float(os.environ["DS_HANG_STARTUP_SECONDS"]),
               "training": float(os.environ["DS_HANG_STEP_SECONDS"]),
               "checkpoint": float(os.environ["DS_HANG_CHECKPOINT_SECONDS"])}
    parent = os.getppid()
    ranks: dict[int, Rank] = {}
    ended: set[int] = set()  # killed here: judged once
    log(f"watching the ranks' progress in {state_dir}: a rank is hung after {budgets['starting']:.0f}s without a "
        f"first step, then {budgets['training']:.0f}s (or {STEP_MULTIPLE}x its step time) without a new one, or "
        f"{budgets['checkpoint']:.0f}s in one save or restore")
    while os.getppid() == parent:
        time.sleep(POLL_S)
        now, wall_now = time.monotonic(), time.time()
        pids = {int(p.name) for p in state_dir.glob("[0-9]*") if p.name.isdigit()} if state_dir.is_dir() else set()
        for pid in list(ranks):
            if pid not in pids:
                del ranks[pid]
        for pid in pids:
            if not Path(f"/proc/{pid}").exists():  # killed without clearing its file
                (state_dir / str(pid)).unlink(missing_ok=True)
                for suffix in (".stacks", FR_REQUEST, FR_DUMP):
                    (state_dir / f"{pid}{suffix}").unlink(missing_ok=True)
                ended.discard(pid)
                continue
            if pid in ended:
                continue
            rank = ranks.get(pid) or ranks.setdefault(pid, Rank(pid))
            if not rank.refresh(state_dir / str(pid), now):
                del ranks[pid]
        hung = [(r, r.quiet_for(now, wall_now), r.budget(budgets)) for r in ranks.values()
                if r.state != "stopping"]
        hung = [h for h in hung if h[1] > h[2]]
        if not hung:
            continue
        victims = list(ranks.values())
        report(hung, victims, state_dir)
        log(f"ending the attempt: SIGKILL to {', '.join(r.name() for r in victims)}")
        for rank in victims:
            try:
                os.kill(rank.pid, signal.SIGKILL)
            except OSError:
                pass
        for rank in victims:
            del ranks[rank.pid]
            ended.add(rank.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
