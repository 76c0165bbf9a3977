"""launchMode nossh: one attempt loop per worker pod (an Indexed Job's), no sshd, no launcher pod.

The hosts meet on worker 0, which owns the job's ledger and serves the channel's hub on the barrier port: every
worker joins it, and worker 0 begins an attempt only when every worker is there between two runs (none with ranks of
an earlier run still alive: a rank of a new attempt would otherwise join the rendezvous of a rank 0 still stuck in
the failed one), then sends the attempt out (`go`, its env) or, when a stop rule ends the job, `stop`. Each worker
then starts DeepSpeed's launcher for its own node rank (`--node_rank=<index>`). When a worker's run ends it sends
its evidence of it (`end`); worker 0 decides why the attempt ended once every worker's evidence is in (or the wait
runs out), then meets them again. A worker that gets SIGTERM says so over the channel (`stopping`) before it stops
its ranks: the attempt is a preemption whichever worker was deleted. A host that leaves a run (SIGTERM, or its
connection dropped mid-run) ends it everywhere at once: worker 0 stops its own ranks and tells the others (`halt`),
whose ranks would otherwise wait for the one that left until a rendezvous or collective timeout (minutes).
"""

import json
import os
import re
import threading
import time

from podruntime import channel, evidence, host, peercopy, protocol, ranks, rankstart
from podruntime.causes import STOPPED
from podruntime.ledger import Began, Ledger, Stopped, last_word
from podruntime.loop import Child
from podruntime.tenantfiles import Tree
from podruntime.text import Log
from podruntime.watchdog import Watchdog

LOG_EVERY_S = 5


class Worker:
    """A nossh worker's side of the loop (Mode); worker 0 also owns the ledger and the hub."""

    def __init__(self, index: int, hosts: list[str], port: int, timeout: float, command: list[str],
                 ledger: Ledger | None, env=os.environ, peer: peercopy.Running | None = None,
                 watchdog: Watchdog | None = None):
        self.index, self.hosts, self.port, self.timeout = index, hosts, port, timeout
        self.watchdog = watchdog
        self.command = [command[0], f"--node_rank={index}", *command[1:]]
        self.ledger, self.env = ledger, env
        # The peer copy (on per-worker volumes): what each host holds goes to worker 0 with its join or end, worker
        # 0's plan (the tag every worker resumes from) with the `go`; each worker prepares its volume before its run.
        self.peer = peer
        self.holds: dict[int, dict] = {}
        self.resumed_before: str | None = None  # the tag an earlier plan of this owner resumed from
        self.resume: dict | None = None
        self.log, self.barrier_log = Log(f"worker {index}"), Log(f"barrier {index}")
        self.child = Child()
        self.stopped = threading.Event()  # SIGTERM: no meeting waits any longer
        self.current: Began | None = None
        self.last: dict | None = None  # this worker's evidence of its last run, until worker 0 has it
        state = env.get(protocol.STATE_DIR_ENV)
        self.state = Tree(state, self.log) if state else None
        self.owner = index == 0
        self.workers = set(range(1, len(hosts)))
        self.hub = channel.Hub(port, self.workers, {"waiting": self.relay_waiting}) if self.owner else None
        self.spoke = None if self.owner else channel.Spoke(index, hosts[0], port, handlers={
            "halt": self.on_halt, "waiting": self.on_waiting})
        if watchdog is not None:
            watchdog.announce = self.announce_waiting
        # The hub's view of the workers, kept by its dispatcher thread: who is ready for the next attempt (joined,
        # or ended the last), who runs the current one, and their evidence of it.
        self.changed = threading.Condition()
        self.ready: set[int] = set()
        self.running: set[int] = set()
        self.found: dict[int, dict] = {}
        self.vanished: set[int] = set()  # workers whose connection dropped mid-attempt without a SIGTERM
        self.stopping: set[int] = set()
        if self.hub is not None:
            threading.Thread(target=self.dispatch, name="dispatch", daemon=True).start()

    # ---- worker 0: the hub's messages

    def dispatch(self) -> None:
        while True:
            index, message = self.hub.inbox.get()
            kind, left = message["m"], None
            who = (message.get("host") or self.hosts[index]).split(".")[0]
            if kind == "stopping":
                self.stopping.add(index)
                self.preempted(message.get("host") or self.hosts[index])
                left = f"{who} got SIGTERM"
            with self.changed:
                if kind in ("join", "end"):
                    if not (kind == "end" and index in self.stopping):  # one that got SIGTERM ends its run and
                        self.ready.add(index)  # leaves: its replacement's join makes it ready, never its end
                    self.take_evidence(index, message.get("evidence"))
                    self.holds[index] = message.get("holds")
                    if kind == "end" and self.current and message["run"] == self.current.env[protocol.ATTEMPT_ENV[
                            "run"]]:
                        self.running.discard(index)  # its run ended (also well: no evidence), and it may leave
                elif kind == "gone":
                    self.ready.discard(index)
                    if index in self.running and index not in self.stopping:
                        self.vanished.add(index)
                        left = f"{who} left without a word (its connection dropped)"
                    self.running.discard(index)
                self.changed.notify_all()
            if left is not None:
                self.halt_everywhere(index, left)

    def take_evidence(self, index: int, found: dict | None) -> None:
        if found and self.current and found["run"] == self.current.env[protocol.ATTEMPT_ENV["run"]]:
            self.found[index] = found
            self.running.discard(index)

    def preempted(self, who: str) -> None:
        if self.current is not None and self.ledger.mark_stopped(self.current.number, who):
            self.barrier_log(f"{who} got SIGTERM: attempt {self.current.number} is a preemption")
            self.ledger.say("stopping", STOPPED)

    def halt_everywhere(self, left: int | None, why: str) -> None:
        """A host left the current run (`left`, or this one on SIGTERM: None): every other worker is told to stop
        its ranks of it, and this host's own are stopped (in a thread: the caller is the dispatcher or a signal
        handler)."""
        run = self.current.env[protocol.ATTEMPT_ENV["run"]] if self.current else ""
        if not run:
            return
        message = channel.encode("halt", run=run, reason=why)
        for index in sorted(self.workers - {left}):
            self.hub.send(index, message)
        if left is not None:
            threading.Thread(target=self.halt, args=(run, why), name="halt", daemon=True).start()

    def halt(self, run: str, why: str) -> None:
        """This host's ranks of `run`, which another host left, stopped now: they save if every rank still can
        (a SIGTERM on every host is a preemption's joint stop), else the rank stopper ends them; the run never starts
        if it had not yet."""
        if not self.child.cancel(run) or self.current is None or self.current.env[protocol.ATTEMPT_ENV["run"]] != run:
            return  # said before; or a run this host has not begun (its `go` not read yet): it will not start
        self.log(f"{why}: {run} cannot go on: stopping this worker's ranks of it")
        ranks.stop_here(self.env, self.log)
        self.child.terminate(run)

    def on_halt(self, message: dict) -> None:
        self.halt(message.get("run", ""), f"worker 0 says {message.get('reason') or 'a host left the run'}")

    # ---- the watchdogs' word that a host's ranks wait in a collective (watchdog.py): worker 0 tells every host

    def announce_waiting(self, run: str, since: float, who: str) -> None:
        if self.hub is not None:
            self.relay_waiting({"run": run, "since": since, "who": who, "index": None})
        else:
            self.spoke.send(channel.encode("waiting", run=run, since=since, who=who))

    def relay_waiting(self, message: dict) -> None:
        """Worker 0: a host's `waiting` (`index`; None: this host's own) to every other host and its watchdog."""
        data = channel.encode("waiting", run=message["run"], since=message["since"], who=message["who"])
        for index in sorted(self.workers - {message["index"]}):
            self.hub.send(index, data)
        if message["index"] is not None:
            self.on_waiting(message)

    def on_waiting(self, message: dict) -> None:
        if self.watchdog is not None:
            self.watchdog.notice(message["run"], message["since"], message["who"])

    def wait_until(self, done, deadline: float, waiting) -> bool:
        """Waits (logging `waiting(left)` every LOG_EVERY_S) until done() under the lock; False at the deadline."""
        next_log = time.monotonic() + LOG_EVERY_S
        with self.changed:
            while not done():
                now = time.monotonic()
                if now >= deadline or self.stopped.is_set():
                    return False
                if now >= next_log:
                    waiting(deadline - now)
                    next_log = now + LOG_EVERY_S
                self.changed.wait(min(1.0, deadline - now))
        return True

    def meet_as_owner(self) -> Began | int:
        deadline = time.monotonic() + self.timeout

        def missing() -> list[int]:
            return sorted(self.workers - self.ready)

        def names() -> str:
            more = f" ... (+{len(missing()) - 5} more)" if len(missing()) > 5 else ""
            return ", ".join(self.hosts[i].split(".")[0] for i in missing()[:5]) + more

        def waiting(left: float) -> None:
            self.barrier_log(f"{len(self.hosts) - len(missing())}/{len(self.hosts)} here; waiting for {names()} "
                             f"({left:.0f}s left)")
            # Where the job stands, for the progress ConfigMap and `make why`: who it waits for, and how long yet.
            self.ledger.say_waiting(f"the start barrier waits for {len(missing())} of {len(self.hosts)} "
                                    f"workers ({names()}): {left:.0f}s more, then the job fails "
                                    "(job.waitTimeoutSeconds)")

        self.barrier_log(f"waiting up to {self.timeout:.0f}s for {len(self.workers)} workers on port {self.port}")
        with self.changed:  # held from the last join to the last `go`: a worker lost meanwhile is waited for again
            if not self.wait_until(lambda: not missing(), deadline, waiting):
                if self.stopped.is_set():
                    return 1  # a stop (the loop says so), not a missing worker
                self.barrier_log(f"ERROR: {len(missing())} of {len(self.hosts)} workers did not reach the start "
                                 "barrier:")
                for i in missing()[:20]:
                    self.barrier_log(f"  {self.hosts[i]}")
                # The job's last word: the barrier's wait is over, not "n s more" (the progress ConfigMap, make why).
                self.ledger.say("failed", f"{len(missing())} of {len(self.hosts)} workers did not reach the start "
                                f"barrier within {self.timeout:.0f}s (job.waitTimeoutSeconds): {names()}")
                return 1
            began = self.ledger.begin()
            ready, self.ready = self.ready, set()
            if isinstance(began, Stopped):
                for i in ready:
                    self.hub.send(i, channel.encode("stop", cause=began.cause, reason=began.line))
                self.barrier_log(began.line)
                return protocol.EXIT_NOT_RETRIED
            plan = self.plan()
            if isinstance(plan, str):  # no tag every worker holds: a stop, in one line, never a start from step 0
                self.ledger.end(began.number, protocol.EXIT_CONFIG_ERROR, [])
                self.ledger.say("failed", f"attempt {began.number} ended: config-error: {plan}", cause="config-error")
                for i in ready:
                    self.hub.send(i, channel.encode("stop", cause="config-error"))
                self.barrier_log(f"ERROR: {plan}")
                return protocol.EXIT_CONFIG_ERROR
            self.current, self.found, self.running = began, {}, set(ready)
            self.vanished, self.stopping = set(), set()
            self.resume = plan.message() if plan else None
            for i in ready:
                self.hub.send(i, channel.encode("go", env=began.env, **({"resume": self.resume} if plan else {})))
            if plan:
                self.barrier_log(plan.line)
                self.ledger.note_resume(began.number, plan.resumed, plan.line)
        Log("attempts")(began.line)
        self.barrier_log(f"all {len(self.hosts)} workers are here: starting the run, {began.line}")
        return began

    def plan(self) -> "peercopy.Plan | str | None":
        """The peer copy's plan from every host's holdings (worker 0's own now, the others' from their join or end);
        None without the peer copy, or when a host's holdings are missing (a worker of an older chart)."""
        if self.peer is None:
            return None
        found = {0: peercopy.holdings(self.peer.ring, self.peer.replicator.volume)}
        for index in self.workers:
            valid = peercopy.valid_holdings(self.holds.get(index), len(self.hosts))
            if valid is None or valid["node"] != index:
                self.barrier_log(f"worker {index} sent no holdings: the peer copy's plan is skipped this attempt")
                return None
            found[index] = valid
        planned = peercopy.plan(found, len(self.hosts), self.resumed_before, peercopy.job_peer_step(self.env))
        if isinstance(planned, peercopy.Plan) and planned.tag:
            self.resumed_before = planned.tag
        return planned

    def holdings(self) -> dict:
        return {"holds": peercopy.holdings(self.peer.ring, self.peer.replicator.volume)} if self.peer else {}

    def gather_as_owner(self, attempt: Began, status: int) -> list[dict]:
        own = evidence.of_run(attempt.env[protocol.ATTEMPT_ENV["run"]], status, self.env, returned=time.time())

        def waiting(left: float) -> None:
            self.barrier_log(f"waiting {left:.0f}s more for the evidence of attempt {attempt.number} from workers "
                             f"{', '.join(str(i) for i in sorted(self.running)[:10])}")

        self.wait_until(lambda: not self.running, time.monotonic() + self.timeout, waiting)
        with self.changed:
            run = attempt.env[protocol.ATTEMPT_ENV["run"]]
            lost = [protocol.host_evidence(self.hosts[i].split(".")[0], run, None, None, [], None, lost=True)
                    for i in sorted(self.vanished - set(self.found))]
            return [e for e in (own, *self.found.values(), *lost) if e]

    # ---- every other worker

    def meet_as_worker(self) -> Began | int:
        deadline, next_log = time.monotonic() + self.timeout, time.monotonic() + LOG_EVERY_S
        while time.monotonic() < deadline and not self.stopped.is_set():
            if self.spoke.sock is None:
                self.spoke.connect(deadline, channel.encode("join", index=self.index, evidence=self.last,
                                                            **self.holdings()), self.stopped)
            try:
                message = self.spoke.inbox.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
                message = {"m": "wait"}
            if message["m"] == "stop":
                cause = message.get("cause") or "a stop rule"
                self.barrier_log(f"worker 0 says the job stops ({cause}: its log says why): failing the job")
                # The Job controller may name this pod's exit as the Job's failure: its last word says why too.
                host.termination_message(last_word("failed", message.get("cause"), message.get("reason")))
                return protocol.EXIT_NOT_RETRIED
            env = attempt_env(message.get("env")) if message["m"] == "go" else None
            if env is not None and env[protocol.ATTEMPT_ENV["attempt"]].isdigit():
                self.last = None
                self.resume = message.get("resume")
                self.current = Began(int(env[protocol.ATTEMPT_ENV["attempt"]]), env, "")
                self.barrier_log("all workers are here: starting the run")
                return self.current
            if time.monotonic() >= next_log:
                self.barrier_log(f"waiting for worker 0 ({self.hosts[0]}:{self.port}) to open the start barrier: "
                                 f"{self.spoke.reason} ({deadline - time.monotonic():.0f}s left)")
                next_log = time.monotonic() + LOG_EVERY_S
        self.barrier_log(f"ERROR: no start barrier on worker 0 ({self.hosts[0]}:{self.port}) within the timeout: "
                         f"{self.spoke.reason}")
        return 1

    # ---- the Mode

    def meet(self) -> Began | int:
        return self.meet_as_owner() if self.owner else self.meet_as_worker()

    def run(self, attempt: Began) -> int:
        run = attempt.env[protocol.ATTEMPT_ENV["run"]]
        if self.peer is not None and self.resume is not None:
            tag = peercopy.valid_tag(self.resume.get("tag"))
            peer = self.resume.get("peer") if isinstance(self.resume.get("peer"), list) else []
            try:
                done = peercopy.prepare(self.peer.ring, self.peer.replicator.volume, tag, self.index in peer)
            except (peercopy.PeerError, OSError) as err:
                self.log(f"ERROR: cannot make this worker's volume ready for {tag}: {err}")
                return 1
            if done:
                self.log(done)
        command = self.command
        if run in self.child.cancelled:
            self.log(f"{run} was halted before it started here (a host left it)")
        else:
            command, how = self.start_command()
            self.log(f"running ({run}): {how}")
        status = self.child.run(command, {**self.env, **attempt.env}, key=run)
        if status == 0 and self.spoke is not None:  # the loop gathers no evidence of a run that ended well: its end
            self.spoke.send(channel.encode("end", index=self.index, run=run, **self.holdings()))  # is no vanishing
        return status

    def start_command(self) -> tuple[list[str], str]:
        """(this run's command, what the log says of it): after a run here, the ranks started by the loop as
        DeepSpeed's launcher started them in it (rankstart.py: two interpreters, each importing torch, fewer);
        on a pod's first run, or where the ranks' records say otherwise, DeepSpeed's runner."""
        if self.child.ended:
            try:
                found = rankstart.plan(self.state, self.command, self.index, self.child.ended)
            except Exception as err:  # noqa: BLE001 - a record no rule foresaw: never the loop's end
                found = f"a record could not be read ({type(err).__name__})"
            if not isinstance(found, str):
                recorded, starts = found
                return (host.pod_program(rankstart.PROGRAM, recorded, *self.command),
                        f"ranks {' '.join(start.env['RANK'] for start in starts)} started by the loop as DeepSpeed's "
                        f"launcher started them in {recorded}")
            self.log(f"DeepSpeed's runner starts the ranks ({found})")
        return self.command, " ".join(self.command)

    def gather(self, attempt: Began, status: int) -> list[dict]:
        if self.owner:
            return self.gather_as_owner(attempt, status)
        self.last = evidence.of_run(attempt.env[protocol.ATTEMPT_ENV["run"]], status, self.env, returned=time.time())
        if self.spoke.send(channel.encode("end", index=self.index, evidence=self.last, **self.holdings())):
            self.last = None
        return []

    def clear(self) -> None:
        """Nothing to stop (DeepSpeed's launcher ends its ranks with it): the workers meet again."""
        self.log("meeting the other workers at the start barrier: the run starts again if the job's failure budget "
                 "allows")

    def stop(self) -> None:
        since = time.monotonic()
        self.stopped.set()
        with self.changed:
            self.changed.notify_all()
        run = self.current.env[protocol.ATTEMPT_ENV["run"]] if self.current else ""
        if self.state is not None:
            self.state.write(protocol.STOP_NOTICE, json.dumps({"run": run, "host": host.hostname(),
                                                               "time": time.time()}))
        if self.owner:
            self.preempted(host.hostname())
            self.halt_everywhere(None, f"{host.hostname().split('.')[0]} got SIGTERM")
        elif self.spoke is not None:
            self.spoke.send(channel.encode("stopping", index=self.index, host=host.hostname(), run=run))
        ranks.stop_here(self.env, Log(f"worker {self.index}"))
        self.child.terminate()
        if self.peer is not None:  # the stop's checkpoint, to the keeper, in what is left of the grace period
            self.peer.flush_after_stop(since)



def attempt_env(env) -> dict[str, str] | None:
    """A `go` message's env: exactly the attempt's keys, values without shell or whitespace characters (empty: an
    attempt with no previous run)."""
    if not isinstance(env, dict) or set(env) != set(protocol.ATTEMPT_ENV.values()):
        return None
    return env if all(isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_./-]{0,64}", v) for v in env.values()) else None
