"""Hang detection for the ranks of this pod, in both launch modes: a thread of the pod's attempt loop (nossh) or of
the ssh worker's agent; no operator, nothing outside the pod.

Every rank that reports progress keeps a state file, DS_RANK_STATE_DIR/<pid> (protocol.rank_line; its mtime the
heartbeat). A rank is hung when its file has not changed for longer than its budget: DS_HANG_STARTUP_SECONDS while
`starting` (from its first report to its first step), while `training` DS_HANG_STEP_SECONDS or STEP_MULTIPLE x its
own recent step time, whichever is larger, and DS_HANG_CHECKPOINT_SECONDS while `restoring` or `saving` (a rank
stopped in the middle of a save hangs its peers there too). Time in those two does not count against the step
budget; `stopping` is never judged (the pod's grace period bounds it), and a program that reports nothing never is.

Two signals end a hang sooner than any budget (DS_HANG_SIGNAL_SECONDS, the signal window; 0: off). Every poll the
watchdog reads each rank's /proc state, the CPU time and read/write bytes of the rank and every process below it
(host.usage: two small reads a process), never the rank itself:
- a rank whose process has been stopped (state T: SIGSTOP, a stop signal) for the whole window, without a step
  meanwhile: it cannot run, and every peer waits for it;
- a rank that made no step, used under IDLE_CPU_SHARE of a core, moved no byte, started no process and had none in
  uninterruptible sleep (D: waiting on storage) for the whole window, outside a checkpoint state, and whose stack
  (one dump, confirmed) is outside any collective with no thread reading the network, while a peer waits in a
  collective: one of this host's ranks (from the same dump), or one on another host, whose watchdog found it
  waiting the same way and said so over the attempt loop's channel (`waiting`, relayed by the ledger's owner to
  every host: set `announce`, feed `notice`). A peer that began waiting long before this rank's last step waited
  for something else. A busy rank (a long first step, an evaluation, a compilation), one still reading (I/O), one
  in a save or restore, and one whose peers do not wait are left to the budgets: a straggler is slow, not hung.
The stacks of ranks without a step for the window are read once, then at doubling intervals while no step comes.

On a hang, before anything is killed, every rank of this pod is asked for its stacks and torch's flight recorder
through its diagnostics FIFO (protocol.DIAG_REQUEST_SUFFIX): a thread of the rank answers with the GIL held, so no
other thread of it runs Python while its frames are read. Only a rank that cannot answer that way (no thread, or one
that never gets the GIL) gets DUMP_SIGNAL, faulthandler's dump from a signal handler, which can read another
thread's frames while they change. The report says, per rank, whether it waits in a collective (it waits for a
peer) or where else it is (the likely culprit), or that the process is stopped. It goes to this pod's log, to the
state directory's hang-<run>.txt and hang-<run>.json (this host's evidence for the ledger's owner) and, with every
stack, to <checkpoints>/_job/diagnostics/<run>/<host>.txt. Then the ranks get SIGKILL: the attempt ends and the loop
starts the next from the last complete checkpoint. The peers on other pods stop progressing too, so their watchdogs
report and end them the same way.
"""

import json
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import pairwise

from podruntime import host, protocol
from podruntime.ledger import component, job_tree
from podruntime.tenantfiles import Tree
from podruntime.text import Log

POLL_S = 1.0
DUMP_WAIT_S = 3.0
COLLECTIVE_PATHS = ("torch/distributed/", "deepspeed/comm/", "deepspeed/runtime/pipe/p2p")
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
STACKS_BYTES = 4 << 20  # of one rank's stacks file
IDLE_CPU_SHARE = 0.02  # of one core, over the window: a CPython whose threads all block uses none
# A thread in one of these reads the network (recv() moves no rchar): a data loader still downloading is not idle.
NETWORK_PATHS = ("/socket.py", "/ssl.py", "/selectors.py", "/http/client.py", "/asyncio/")
LOOK_AGAIN_MAX_S = 300.0  # the stacks of ranks without a step are read again at doubling intervals, up to this
CLOCK_SKEW_S = 60.0  # hosts' wall clocks may differ by this much (a `waiting` carries the wall time of a last step)


class Rank:
    """What the watchdog knows of one rank process."""

    def __init__(self, pid: int):
        self.pid, self.uncounted_until = pid, 0.0
        self.state, self.step, self.step_s, self.mtime = "starting", None, 0.0, time.time()
        self.env = host.environ(pid)
        self.samples: deque[tuple[float, dict[int, host.Usage]]] = deque()  # (monotonic time, its processes' usage)
        # Reading its stacks makes the rank write them (CPU, I/O): idle_for starts again at the first sample after
        # each reading, and the idle time before it carries over while the samples since stay idle.
        self.asked_at, self.idle_before, self.restarted_at, self.carried = 0.0, 0.0, 0.0, 0.0

    def sample(self, now: float, usages: dict[int, host.Usage], window: float) -> None:
        """Keeps the samples of the last `window` seconds, and the one just before them."""
        if self.asked_at > self.restarted_at:  # the first sample since its stacks were read
            self.restarted_at, self.carried = now, (self.idle_before + now - self.asked_at) if self.idle_before else 0
        self.samples.append((now, usages))
        while len(self.samples) > 2 and self.samples[1][0] <= now - window:
            self.samples.popleft()

    def stopped_for(self, now: float) -> float:
        """Seconds the rank's process has been in state T in every sample since (0: it runs)."""
        since = now
        for at, usages in reversed(self.samples):
            if (found := usages.get(self.pid)) is None or found.state != "T":
                break
            since = at
        return now - since

    def idle_for(self, now: float) -> float:
        """Seconds over which the rank's processes, sample after sample, used under IDLE_CPU_SHARE of a core, moved no
        byte, started no process and had none in state D (0: not idle); idle back to the first sample after the last
        reading of its stacks, the idle time before that reading counts too."""
        since, ticks = now, 0
        for (at, older), (_, newer) in reversed(list(pairwise(self.samples))):
            if at < self.restarted_at:  # the reading lies between these two
                return now - since + self.carried
            if not newer.keys() <= older.keys() or any(u.state == "D" or u.io_bytes is None
                                                       or older[pid].io_bytes != u.io_bytes
                                                       for pid, u in newer.items()):
                return now - since
            ticks += sum(u.cpu_ticks - older[pid].cpu_ticks for pid, u in newer.items())
            if ticks > max(1.0, IDLE_CPU_SHARE * (now - at) * host.TICKS_PER_S):
                return now - since
            since = at
        return now - since + (self.carried if self.samples and self.samples[0][0] == self.restarted_at else 0.0)

    def stacks_read(self, at: float) -> None:
        """Its stacks were read from `at` to now (see idle_for)."""
        self.asked_at, self.idle_before = at, self.idle_for(at)

    def refresh(self, state: Tree, now: float) -> bool:
        """Re-reads the state file; False when it is gone."""
        found = state.read_with_mtime(str(self.pid), protocol.MAX_LINE_BYTES)
        if found is None:
            return False
        word, fields = protocol.rank_line(found[0].decode(errors="replace"))
        self.mtime = found[1]
        self.state = word or "training"  # a bare touch is a heartbeat
        self.step = int(fields["step"]) if fields.get("step", "").isdigit() else self.step
        step_s = protocol.number(fields.get("step_s", 0))
        self.step_s = step_s if step_s is not None and 0 <= step_s < 86400 else 0.0  # nonsense: the plain budget
        if self.state in protocol.CHECKPOINT_STATES:
            self.uncounted_until = now
        return True

    def budget(self, budgets: dict[str, float]) -> float:
        if self.state == "training":
            return max(budgets["training"], protocol.STEP_MULTIPLE * self.step_s)
        return budgets["checkpoint" if self.state in protocol.CHECKPOINT_STATES else self.state]

    def quiet_for(self, now: float, wall_now: float) -> float:
        """Seconds without progress: since the last report (the first one, for a rank still starting; the start of
        the save or restore, for one in a checkpoint state), or, training, since the end of the last checkpoint
        state."""
        if self.state in protocol.CHECKPOINT_STATES:
            return wall_now - self.mtime
        return min(wall_now - self.mtime, now - self.uncounted_until)

    def name(self) -> str:
        return f"rank {self.env.get('RANK', '?')} (pid {self.pid}, local rank {self.env.get('LOCAL_RANK', '?')})"


def run_of(ranks: list[Rank]) -> str:
    """The run these ranks belong to (their DS_RUN_ID), as a file name may hold it."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", next((r.env["DS_RUN_ID"] for r in ranks if r.env.get("DS_RUN_ID")), "run"))


def reads_network(stacks: str) -> bool:
    """Some thread of the rank is in a network read (socket, ssl, http, asyncio): it may still be receiving."""
    return any(any(part in file for part in NETWORK_PATHS) for file, _, _ in frames_of(stacks))


def frames_of(stacks: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of every frame of every thread."""
    return [(m["file"], int(m["line"]), m["func"]) for m in map(FRAME.match, stacks.splitlines()) if m]


def main_thread(stacks: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread, innermost first: the thread whose oldest frame is not threading's
    bootstrap (faulthandler prints threads most recent call first)."""
    threads = [[m for m in map(FRAME.match, block.splitlines()) if m]
               for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks)]
    threads = [t for t in threads if t]
    main = [t for t in threads if not t[-1]["file"].endswith("threading.py")] or threads
    return [(m["file"], int(m["line"]), m["func"]) for m in main[-1]] if main else []


def describe(frames: list[tuple[str, int, str]]) -> tuple[bool, str]:
    """(waits in a collective, where): the innermost collective call, or the innermost frame of the program."""
    for file, line, func in frames:
        if any(part in file for part in COLLECTIVE_PATHS):
            caller = next((f"{os.path.basename(f)}:{n} in {fn}" for f, n, fn in frames
                           if not any(p in f for p in COLLECTIVE_PATHS) and "site-packages/deepspeed" not in f), "")
            return True, f"waits in a collective: {func} ({file}:{line})" + (f", called from {caller}" if caller
                                                                                else "")
    file, line, func = frames[0]
    return False, f"in {func} ({file}:{line}), not in a collective"


def last_collective(dump: dict) -> str:
    """Where the rank's collectives stand: the oldest one still pending (it waits there for a peer), else the newest
    completed (a rank whose collectives all completed never reached the one its peers wait in). Sequence numbers
    count per process group, so the group is named; record_id orders entries across groups. Gloo records no start or
    end events: its entries say `scheduled` until retired."""
    entries = [e for e in dump.get("entries", []) if isinstance(e, dict) and not e.get("is_p2p")]
    if not entries:
        return "no collective recorded"
    pending = [e for e in entries if not e.get("retired")]
    entry = (min(pending, key=lambda e: protocol.number(e.get("record_id")) or 0) if pending
             else max(entries, key=lambda e: protocol.number(e.get("record_id")) or 0))
    groups = entry.get("process_group") if isinstance(entry.get("process_group"), list) else ["?"]
    state = f"pending, {entry.get('state', '?')}" if pending else "completed"
    return (f"last recorded collective #{entry.get('collective_seq_id')} {entry.get('profiling_name', '?')} in "
            f"group {(groups or ['?'])[-1]} ({state})")


class Dumps:
    """Every rank's stacks and flight recorder, asked for at once (one wait for all), by the FIFO first."""

    def __init__(self, state: Tree, ranks: list[Rank]):
        self.state, self.ranks = state, ranks
        self.sizes = {r.pid: (info.st_size if (info := state.stat(f"{r.pid}{protocol.STACKS_SUFFIX}")) else 0)
                      for r in ranks}
        self.stacks: dict[int, str] = {}
        self.recorders: dict[int, dict] = {}

    def collect(self, by_signal: bool = True) -> None:
        """by_signal=False: by the FIFO only. A rank whose program never registered faulthandler would die of
        DUMP_SIGNAL (its default action), which only a rank about to be killed may risk."""
        for rank in self.ranks:
            self.state.remove(f"{rank.pid}{protocol.FR_DUMP_SUFFIX}")
        # A stopped process answers nothing until it runs again: it is not waited for.
        running = [r for r in self.ranks if not host.process_state(r.pid).startswith("T")]
        asked = [r for r in running if self.state.poke_fifo(
            f"{r.pid}{protocol.DIAG_REQUEST_SUFFIX}", protocol.DIAG_STACKS + protocol.DIAG_FLIGHT_RECORDER)]
        self._wait(asked, recorders=True)
        if not by_signal:
            return
        # A rank with no diagnostics thread, or one that never got the GIL: faulthandler from a signal handler.
        silent = [r for r in running if r.pid not in self.stacks]
        for rank in silent:
            try:
                os.kill(rank.pid, protocol.DUMP_SIGNAL)
            except OSError:
                pass
        self._wait(silent, recorders=False)

    def _wait(self, ranks: list[Rank], recorders: bool) -> None:
        deadline = time.monotonic() + DUMP_WAIT_S
        while ranks and time.monotonic() < deadline:
            time.sleep(0.2)
            for rank in ranks:
                self._take(rank, recorders)
            if all(r.pid in self.stacks and (not recorders or r.pid in self.recorders) for r in ranks):
                return

    def _take(self, rank: Rank, recorders: bool) -> None:
        name = f"{rank.pid}{protocol.STACKS_SUFFIX}"
        info = self.state.stat(name)
        if rank.pid not in self.stacks and info and info.st_size > self.sizes[rank.pid]:
            time.sleep(0.2)  # let the writer finish
            text = (self.state.read(name, STACKS_BYTES) or b"").decode(errors="replace")
            self.stacks[rank.pid] = text[self.sizes[rank.pid]:]
        if recorders and rank.pid not in self.recorders:
            dump = self.state.read_json(f"{rank.pid}{protocol.FR_DUMP_SUFFIX}", 16 << 20)
            if dump is not None:
                self.recorders[rank.pid] = dump


class Watchdog:
    def __init__(self, state: Tree, budgets: dict[str, float], checkpoints: Tree | None, log: Log):
        self.state, self.budgets, self.checkpoints, self.log = state, budgets, checkpoints, log
        self.ranks: dict[int, Rank] = {}
        self.ended: set[int] = set()  # killed here: judged once
        # The idle-rank signal: who was looked at (pids), the dump and each rank's place then, when to look again.
        self.looked: tuple[frozenset[int], Dumps, dict[int, tuple[str, str, str]]] | None = None
        self.look_again_at, self.look_every = 0.0, budgets.get("signals", 0.0)
        self.announce: Callable[[str, float, str], None] | None = None  # (run, since, who): this host's ranks wait
        self.waiting: dict[str, list[tuple[float, str]]] = {}  # run -> (since, who) of peers waiting on other hosts
        self.lock = threading.Lock()

    @classmethod
    def from_env(cls, env=os.environ, log: Log | None = None) -> "Watchdog | None":
        """The watchdog of this pod when DS_HANG_DETECTION is on, else None."""
        if env.get("DS_HANG_DETECTION", "off") != "on":
            return None
        budgets = {"starting": float(env["DS_HANG_STARTUP_SECONDS"]), "training": float(env["DS_HANG_STEP_SECONDS"]),
                   "checkpoint": float(env["DS_HANG_CHECKPOINT_SECONDS"]),
                   "signals": float(env.get("DS_HANG_SIGNAL_SECONDS", "0") or 0)}
        checkpoints = env.get("DS_CHECKPOINT_DIR", "")
        log = log or Log(f"watchdog: {host.hostname()}")
        return cls(Tree(env[protocol.STATE_DIR_ENV], log), budgets, Tree(checkpoints, log) if checkpoints else None,
                   log)

    def start(self, stop: threading.Event) -> threading.Thread:
        signals = self.budgets.get("signals", 0)
        self.log(f"watching the ranks' progress in {self.state.path()}: a rank is hung after "
                 f"{self.budgets['starting']:.0f}s without a first step, then {self.budgets['training']:.0f}s (or "
                 f"{protocol.STEP_MULTIPLE}x its step time) without a new one, or {self.budgets['checkpoint']:.0f}s "
                 "in one save or restore" + (f"; sooner, {signals:.0f}s stopped, or idle outside any collective "
                                             "while a peer waits in one" if signals > 0 else ""))
        thread = threading.Thread(target=self.run, args=(stop,), name="watchdog", daemon=True)
        thread.start()
        return thread

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            self.check(time.monotonic(), time.time())

    def refresh(self, now: float) -> None:
        pids = {int(name) for name in self.state.names(pattern=protocol.RANK_FILE)}
        for pid in [p for p in self.ranks if p not in pids]:
            del self.ranks[pid]
        for pid in pids:
            if not host.alive(pid):  # killed without clearing its file
                for suffix in ("", *protocol.RANK_SUFFIXES):
                    self.state.remove(f"{pid}{suffix}")
                self.ended.discard(pid)
                self.ranks.pop(pid, None)
                continue
            if pid in self.ended:
                continue
            rank = self.ranks.get(pid) or self.ranks.setdefault(pid, Rank(pid))
            if not rank.refresh(self.state, now):
                del self.ranks[pid]

    def check(self, now: float, wall_now: float) -> None:
        self.refresh(now)
        judged = [r for r in self.ranks.values() if r.state != "stopping"]
        quiet = {r.pid: r.quiet_for(now, wall_now) for r in judged}
        hung = [(r, quiet[r.pid], f"budget {budget:.0f}s") for r in judged
                if quiet[r.pid] > (budget := r.budget(self.budgets))]
        dumps = None
        if not hung and self.budgets.get("signals", 0) > 0:
            hung, dumps = self.signals(now, quiet, judged)
        if not hung:
            return
        victims = list(self.ranks.values())
        self.report(hung, victims, dumps)
        self.log(f"ending the attempt: SIGKILL to {', '.join(r.name() for r in victims)}")
        for rank in victims:
            try:
                os.kill(rank.pid, signal.SIGKILL)
            except OSError:
                pass
            del self.ranks[rank.pid]
            self.ended.add(rank.pid)
        self.looked, self.look_every = None, self.budgets.get("signals", 0.0)

    def signals(self, now: float, quiet: dict[int, float], ranks: list[Rank]) -> tuple[
            list[tuple[Rank, float, str]], "Dumps | None"]:
        """The ranks found hung by their signals before any budget (the module's doc), and the dump that confirmed
        it (None: none was needed). `quiet`: each rank's seconds without progress (Rank.quiet_for)."""
        window = self.budgets["signals"]
        trees = host.descendants([r.pid for r in ranks])
        for rank in ranks:
            rank.sample(now, {pid: found for pid in trees.get(rank.pid, [rank.pid])
                              if (found := host.usage(pid)) is not None}, window)
        stopped = [(r, quiet[r.pid], "its process stopped all that time") for r in ranks
                   if quiet[r.pid] >= window and r.stopped_for(now) >= window]
        if stopped:
            return stopped, None
        # Ranks without a step for the window, outside a save or restore: their stacks say who waits (busy NCCL
        # waits spin: a waiting rank need not be idle) and who is stuck elsewhere.
        quiet_ranks = [r for r in ranks if r.state not in protocol.CHECKPOINT_STATES and quiet[r.pid] >= window]
        if not quiet_ranks:
            self.looked, self.look_every = None, window
            return [], None
        pids = frozenset(r.pid for r in quiet_ranks)
        if self.looked is None or self.looked[0] != pids or now >= self.look_again_at:
            dumps = Dumps(self.state, ranks)
            dumps.collect(by_signal=False)
            for rank in ranks:
                rank.stacks_read(now)
            self.looked = (pids, dumps, {r.pid: self.place(r, dumps) for r in ranks})
            self.look_again_at = now + self.look_every
            self.look_every = min(LOOK_AGAIN_MAX_S, 2 * self.look_every)
            waiting = [r for r in quiet_ranks if self.looked[2][r.pid][0] == "in-collective"]
            if waiting:
                self.said_waiting(waiting, quiet, ranks, dumps)
        _, dumps, places = self.looked
        culprits = [r for r in quiet_ranks if places.get(r.pid, ("",))[0] == "outside-collective"
                    and r.idle_for(now) >= window and not reads_network(dumps.stacks.get(r.pid, ""))]
        if not culprits:
            return [], None
        here = [r for r in ranks if places.get(r.pid, ("",))[0] == "in-collective"]
        who = (f"{here[0].name()} on {host.hostname()}" if here
               else self.waits_elsewhere(run_of(culprits), min(r.mtime for r in culprits) - window))
        if not who:
            return [], None
        return [(r, quiet[r.pid], f"no CPU and no I/O all that time, outside any collective, while {who} waits in one")
                for r in culprits], dumps

    def said_waiting(self, waiting: list[Rank], quiet: dict[int, float], ranks: list[Rank], dumps: "Dumps") -> None:
        """This host's ranks wait in a collective with no step for the window: where every rank is, in the log and
        beside the checkpoints (the stacks and flight recorders of the ranks that wait: what a person reads beside
        the culprit's), and, through `announce`, to the other hosts."""
        name, run = host.hostname(), run_of(waiting)
        lines = [f"waiting on {name} ({run}): " + "; ".join(
            f"{r.name()} has made no step for {quiet[r.pid]:.0f}s, waiting in a collective" for r in waiting)]
        lines += [f"  {r.name()} on {name}: {self.looked[2][r.pid][2]}" for r in ranks if r.pid in self.looked[2]]
        for line in lines:
            self.log(line.strip())
        self.keep_diagnostics(run, "\n".join(lines), ranks, dumps)
        if self.announce is not None:
            self.announce(run, min(r.mtime for r in waiting), f"{waiting[0].name()} on {name}")

    def notice(self, run: str, since: float, who: str) -> None:
        """Another host's ranks of `run` wait in a collective since `since` (wall time of their last step): its
        watchdog said so over the channel. A time ahead of this host's clock by more than CLOCK_SKEW_S is no wait."""
        if since > time.time() + CLOCK_SKEW_S:
            return
        with self.lock:
            for old in [r for r in self.waiting if r != run]:
                del self.waiting[old]  # one run at a time: an older run's waits are over
            self.waiting.setdefault(run, []).append((since, who))
            del self.waiting[run][:-64]

    def waits_elsewhere(self, run: str, after: float) -> str:
        """Who waits in a collective of `run` on another host since `after` or later, or ""."""
        with self.lock:
            return next((who for since, who in reversed(self.waiting.get(run, [])) if since >= after), "")

    def report(self, hung: list[tuple[Rank, float, str]], ranks: list[Rank], dumps: "Dumps | None" = None) -> None:
        name = host.hostname()
        if dumps is None:
            dumps = Dumps(self.state, ranks)
            dumps.collect()
        run = run_of(ranks)
        lines = [f"hang on {name} ({run}): " + "; ".join(
            f"{rank.name()} made no progress for {quiet:.0f}s ({why}, {rank.state}"
            + (f" after step {rank.step}" if rank.step is not None else "") + ")" for rank, quiet, why in hung)]
        found = []  # protocol.hang_rank of every rank: what the ledger's owner merges
        for rank in ranks:
            kind, where, verdict = self.place(rank, dumps)
            lines.append(f"  {rank.name()} on {name}: {verdict}")
            found.append(protocol.hang_rank(rank.env.get("RANK", -1), name, kind, rank.mtime, rank.step, rank.state,
                                            where))
        for line in lines:
            self.log(line.strip())
        self.state.write(protocol.HANG_TEXT.format(run=run), "\n".join(lines) + "\n")
        self.state.write(protocol.HANG_JSON.format(run=run),
                         json.dumps(protocol.hang_report(name, run, time.time(), found)) + "\n")
        self.keep_diagnostics(run, "\n".join(lines), ranks, dumps)

    @staticmethod
    def place(rank: Rank, dumps: Dumps) -> tuple[str, str, str]:
        """(how the rank was found: protocol.KINDS, where it is, the report's verdict)."""
        state = host.process_state(rank.pid)
        frames = main_thread(dumps.stacks.get(rank.pid, ""))
        if state.startswith("T"):
            kind, where = "stopped", f"process stopped ({state})"
            verdict = f"{where}: it cannot run, nor answer for its stack; likely the culprit"
        elif frames:
            waits, where = describe(frames)
            kind = "in-collective" if waits else "outside-collective"
            verdict = where + ("" if waits else "; likely the culprit: its peers wait for it")
        else:
            kind, where = "unresponsive", f"no stack (process {state})"
            verdict = f"{where}; the program did not register train.rankstate's stack dump"
        if rank.pid in dumps.recorders:
            verdict += f"; {last_collective(dumps.recorders[rank.pid])}"
        return kind, where, verdict

    def keep_diagnostics(self, run: str, text: str, ranks: list[Rank], dumps: Dumps) -> None:
        """Every rank's stacks and flight recorder beside the checkpoints (the last protocol.KEEP_RUNS runs')."""
        if self.checkpoints is None or not self.checkpoints.is_dir():
            return
        name = host.hostname()
        diagnostics = job_tree(self.checkpoints, protocol.DIAGNOSTICS)
        full = "\n\n".join(f"===== {r.name()}: stacks\n{dumps.stacks.get(r.pid, '(none)')}" for r in ranks)
        if not diagnostics.write(f"{run}/{name}.txt", f"{text}\n\n{full}\n"):
            self.log(f"could not write {diagnostics.path(run)}")
            return
        for rank in ranks:
            if rank.pid in dumps.recorders:
                which = component(rank.env.get("RANK", ""), str(rank.pid))
                diagnostics.write(f"{run}/{name}-rank{which}{protocol.FR_DUMP_SUFFIX}",
                                  json.dumps(dumps.recorders[rank.pid]))
        diagnostics.prune("", protocol.KEEP_RUNS, spare=run)
        self.log(f"stacks of every rank here: {diagnostics.path(f'{run}/{name}.txt')}"
                 + (f"; flight recorders: {diagnostics.path(run)}/{name}-rank<N>{protocol.FR_DUMP_SUFFIX}"
                    if dumps.recorders else ""))
