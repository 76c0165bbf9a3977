"""launchMode ssh: one attempt loop, in the launcher pod, owns the job's ledger and drives passive workers over SSH
(each worker pod runs a non-root sshd and this module's agent, `ssh-worker`).

Meeting: every worker in the hostfile resolves, accepts an SSH login and runs the current worker template (its
DS_WORKER_TEMPLATE equals the launcher's: during a rollout, pods of the previous revision still answer, and pdsh
would start ranks on a pod about to be replaced), and is cleared of ranks an earlier attempt left, in the same SSH
session (one round trip per worker, at most DS_WAIT_PARALLEL at a time); or the meeting fails at the deadline naming
the workers still missing. Run: DeepSpeed's runner over pdsh (its ranks get the attempt's env through
~/.deepspeed_env). The channel: the launcher keeps a connection to every worker's agent (channel.Listener on the
channel port), over which a worker that gets SIGTERM says so before its ranks stop. Evidence: one pdsh round after a
failed run. A stop: the ranks on every worker get SIGTERM (ranks.py: they agree on a step, save it and exit) while the
run's own pdsh still relays their last lines; DeepSpeed's runner, signalled first, would cut pdsh off and the stop's
step and checkpoint would go unseen.
"""

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from podruntime import channel, checkpoints, evidence, host, ownership, peercopy, protocol, ranks
from podruntime.causes import STOPPED
from podruntime.ledger import Began, Ledger, Stopped, last_word
from podruntime.loop import Child, hosts_of
from podruntime.tenantfiles import Tree
from podruntime.text import Log, lines
from podruntime.watchdog import Watchdog

SCRIPTS = host.runnable_dir() or "/etc/deepspeed/scripts"
POD_PROGRAM = ["python3", "-I", SCRIPTS]  # a pod program, as a worker's shell runs it
# The rank stopper on a worker, where it has ranks (usually none: one pgrep says so, no interpreter starts). The
# brackets keep pgrep from finding this very command line.
STOP_RANKS = (f"pgrep -u \"$(id -u)\" -f -- '{ranks.LAUNCHER.replace('.', '[.]')}|[-]-local_rank=' > /dev/null && "
              f"{' '.join(POD_PROGRAM)} stop-ranks")
LOG_EVERY_S = 10
FIRST_PAUSES = (0.1, 0.25, 0.5)  # the first rounds come sooner: pods that are starting answer within a second
EVIDENCE_S = 120  # one pdsh round for every worker's evidence of a failed run
# After a stop: the launcher's grace period is the workers' + 30 s (templates/job.yaml) and the ranks' save may take
# all of theirs but 10 s (killGraceSeconds), so 40 s are left; 10 s ran out on a loaded 2-CPU node (CI: a deleted
# launcher's attempt lost its step, `make why` said none), 20 s leaves the ledger's write 20 s.
EVIDENCE_AFTER_STOP_S = 20


def pdsh_env(env=os.environ) -> dict[str, str]:
    """pdsh's ssh reads our config (port, key, known_hosts) whatever the passwd home says."""
    return {**env, "PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {env.get('HOME', '')}/.ssh/config"}


def pdsh(hosts: list[str], command: list[str], env=os.environ, **popen) -> subprocess.CompletedProcess:
    """`command` on every host at once (pdsh pastes it into one remote shell line: our own words only); its output
    as pdsh gives it, `host: line`."""
    return subprocess.run(["pdsh", "-S", "-f", str(max(1, len(hosts))), "-w", ",".join(hosts), *command],
                          env=pdsh_env(env), capture_output=True, text=True, errors="replace", **popen)


class Meeting:
    """The launcher's wait for its workers (see the module's docstring)."""

    def __init__(self, hosts: list[str], timeout: float, interval: float, then: str, env=os.environ,
                 stop: threading.Event | None = None, waiting=None):
        self.hosts, self.timeout, self.interval, self.then = hosts, timeout, interval, then
        self.waiting = waiting  # said (one line) with each wait's log line: where the job stands
        self.stop = stop or threading.Event()  # set: the meeting ends at once (a SIGTERM)
        self.template = env.get("DS_WORKER_TEMPLATE", "")
        self.parallel = int(env.get("DS_WAIT_PARALLEL", "32") or 32)
        self.home = env.get("HOME", "")
        self.log = Log("wait-for-workers")

    def remote(self) -> str:
        command = 'echo "template=$DS_WORKER_TEMPLATE"'
        if self.then and self.template:
            command += f'; if [ "$DS_WORKER_TEMPLATE" = {shlex.quote(self.template)} ]; then {self.then} || true; fi'
        elif self.then:
            command += f"; {self.then} || true"
        return command

    def check(self, name: str) -> tuple[str, str]:
        """(why the host is not ready, "" when it is; what the clean-up said there)."""
        try:
            done = subprocess.run(["ssh", "-F", f"{self.home}/.ssh/config", "-n", "-o", "ConnectTimeout=5", name,
                                   self.remote()], capture_output=True, text=True, errors="replace", timeout=120)
        except subprocess.TimeoutExpired:
            return "SSH failed: no answer within 120s", ""
        out = (done.stdout + done.stderr).strip("\n") if done.returncode else done.stdout.strip("\n")
        if done.returncode != 0:
            return ("no DNS record" if "Could not resolve hostname" in out else
                    f"SSH failed: {' '.join(lines(out)) or 'no output'}"), ""
        first, _, said = out.partition("\n")
        if self.template and first != f"template={self.template}":
            return (f"runs worker template {first.removeprefix('template=')}, not {self.template}: a pod of an earlier "
                    "revision, the rollout is not done"), ""
        return "", said

    def run(self) -> int:
        """0 once every host is ready; 1 at the deadline; 2 without hosts."""
        if not self.hosts:
            self.log("ERROR: the hostfile lists no hosts")
            return 2
        total, started = len(self.hosts), time.monotonic()
        self.log(f"waiting up to {self.timeout:.0f}s for {total} workers (DNS, SSH, worker template "
                 f"{self.template or 'any'})" + (f", then on each: {self.then}" if self.then else ""))
        pending, last_count, next_log, round_ = list(self.hosts), -1, 0.0, 0
        with ThreadPoolExecutor(max_workers=max(1, self.parallel)) as pool:
            while True:
                results = dict(zip(pending, pool.map(self.check, pending), strict=True))
                for name in pending:
                    for line in lines(results[name][1]):
                        print(line, flush=True)
                pending = [name for name in pending if results[name][0]]
                elapsed = time.monotonic() - started
                if not pending:
                    self.log(f"all {total} workers are reachable after {elapsed:.0f}s")
                    return 0
                if elapsed >= self.timeout or self.stop.is_set():
                    self.log(f"ERROR: {len(pending)} of {total} workers still unreachable after {self.timeout:.0f}s:")
                    for name in pending:
                        self.log(f"  {name}: {results[name][0]}")
                    return 1
                if len(pending) != last_count or time.monotonic() >= next_log:
                    shown = " ".join(pending[:5]) + (f" ... (+{len(pending) - 5} more)" if len(pending) > 5 else "")
                    self.log(f"{total - len(pending)}/{total} ready; waiting for: {shown} "
                             f"({self.timeout - elapsed:.0f}s left)")
                    if self.waiting is not None:  # who, why the first of them is not ready, how long yet
                        self.waiting(f"the launcher waits for {len(pending)} of {total} workers ({shown}; "
                                     f"{pending[0].split('.')[0]}: {results[pending[0]][0]}): "
                                     f"{self.timeout - elapsed:.0f}s more, then the job fails (job.waitTimeoutSeconds)")
                    last_count, next_log = len(pending), time.monotonic() + LOG_EVERY_S
                self.stop.wait(FIRST_PAUSES[round_] if round_ < len(FIRST_PAUSES) else self.interval)
                round_ += 1


def collect(output: str, valid=protocol.valid_host_evidence) -> tuple[list[dict], list[str]]:
    """pdsh's `host: line` output of a record per worker (each host's evidence; `valid` types it): (the records,
    every other line). A host's last line without a newline runs into the next host's first (pdsh writes them as
    they come): what follows a record on its line is a line of its own."""
    found, others, decoder = [], [], json.JSONDecoder()
    pending = lines(output)
    while pending:
        line = pending.pop(0)
        name, _, text = line.partition(": ")
        if text.startswith('{"v"'):
            try:
                record, end = decoder.raw_decode(text[:channel.LINE_BYTES])
            except (ValueError, RecursionError):
                continue
            checked = valid(record)
            if checked:
                found.append(checked)
            if text[end:].strip():
                pending.insert(0, text[end:])
        elif line:
            others.append(line)
    return found, others


class Launcher:
    """The ssh launcher's side of the loop (Mode): it owns the ledger, and a channel to every worker's agent."""

    def __init__(self, command: list[str], ledger: Ledger, env=os.environ):
        self.command, self.ledger, self.env = command, ledger, env
        self.log = Log("launcher")
        self.hosts = hosts_of(f"{env['DS_CONFIG_DIR']}/hostfile")
        self.inbox: queue.Queue = queue.Queue()
        port = int(env.get("DS_CHANNEL_PORT", "0") or 0)
        self.spokes = [channel.Spoke(i, name, port, self.inbox, {"waiting": self.relay_waiting})
                       for i, name in enumerate(self.hosts)] if port else []
        threading.Thread(target=self.dispatch, name="dispatch", daemon=True).start()
        self.child = Child()
        self.stopped = threading.Event()  # SIGTERM: the meeting waits no longer
        self.current: Began | None = None
        self.in_run = False
        self.vanished: set[int] = set()  # workers whose channel dropped mid-run without a SIGTERM
        self.stopping: set[int] = set()
        # The peer copy (per-worker volumes): the plan of the attempt (peercopy.py), made once the workers met.
        self.peer_copy = bool(env.get(peercopy.PORT_ENV)) and len(self.hosts) > 1
        self.resume: peercopy.Plan | None = None
        self.resumed_before: str | None = None  # the tag an earlier plan of this launcher resumed from

    def meet(self) -> Began | int:
        began = self.ledger.begin()
        if isinstance(began, Stopped):
            Log("attempts")(began.line)
            return protocol.EXIT_NOT_RETRIED
        self.current = began
        Log("attempts")(began.line)
        timeout = float(self.env.get("DS_WAIT_TIMEOUT_SECONDS", "300") or 300)
        status = Meeting(self.hosts, timeout, 1.0, STOP_RANKS, self.env, self.stopped,
                         waiting=self.ledger.say_waiting).run()
        if status != 0:
            self.ledger.end(began.number, status, [])
            return status
        self.ledger.waited()  # no longer "the launcher waits for ...", once the ranks start
        plan = self.plan()
        if isinstance(plan, str):  # no tag every worker holds: a stop, in one line, never a start from step 0
            self.ledger.end(began.number, protocol.EXIT_CONFIG_ERROR, [])
            self.ledger.say("failed", f"attempt {began.number} ended: config-error: {plan}", cause="config-error")
            self.log(f"ERROR: {plan}")
            return protocol.EXIT_CONFIG_ERROR
        self.resume = plan
        if plan is not None:
            self.log(plan.line)
            self.ledger.note_resume(began.number, plan.resumed, plan.line)
        self.connect()
        return began

    def plan(self) -> "peercopy.Plan | str | None":
        """The peer copy's plan from every worker's holdings (one pdsh round); None without the peer copy or when a
        worker's holdings did not come (then every worker resumes from what its own volume holds, as without it)."""
        if not self.peer_copy:
            return None
        nodes = len(self.hosts)
        done = pdsh(self.hosts, [*POD_PROGRAM, "peer-holdings"], self.env, timeout=EVIDENCE_S)
        records, others = collect(done.stdout, lambda record: peercopy.valid_holdings(record.get("holds"), nodes))
        for line in others:
            print(line, flush=True)
        found = {record["node"]: record for record in records}
        if set(found) != set(range(nodes)):
            missing = sorted(set(range(nodes)) - set(found))
            self.log(f"no holdings from worker(s) {', '.join(map(str, missing[:10]))}: the peer copy's plan is skipped "
                     "this attempt")
            return None
        planned = peercopy.plan(found, nodes, self.resumed_before, peercopy.job_peer_step(self.env))
        if isinstance(planned, peercopy.Plan) and planned.tag:
            self.resumed_before = planned.tag
        return planned

    def prepare(self) -> int:
        """Every worker's volume made ready for the plan's tag (one pdsh round); 0, or 1 with what went wrong."""
        plan = self.resume
        if plan is None or not plan.prepares or not checkpoints.is_tag_name(plan.tag):
            return 0
        peer = ",".join(str(n) for n in plan.peer)
        done = pdsh(self.hosts, [*POD_PROGRAM, "peer-prepare", shlex.quote(plan.tag), *([peer] if peer else [])],
                    self.env)
        for line in lines(done.stdout + done.stderr):
            print(line, flush=True)
        if done.returncode != 0:
            self.log(f"ERROR: a worker's volume could not be made ready for {plan.tag}: the attempt fails (its lines "
                     "above say why)")
            return 1
        return 0

    def connect(self) -> None:
        """The channel to every worker's agent (they answer SSH, so they listen), again where it dropped; one that
        cannot be reached is said and left: its evidence still says whether its pod got SIGTERM."""
        hello = channel.encode("join", index=0)
        missing = [spoke for spoke in self.spokes if spoke.sock is None]
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(missing)))) as pool:
            pool.map(lambda spoke: spoke.connect(time.monotonic() + 5, hello, self.stopped), missing)
        for spoke in [spoke for spoke in missing if spoke.sock is None]:
            self.log(f"no channel to {spoke.host0}:{spoke.port} ({spoke.reason}): its SIGTERM reaches the ledger "
                     "with its evidence only")

    def relay_waiting(self, message: dict) -> None:
        """A worker's watchdog found its ranks waiting in a collective (watchdog.py): said to every other worker."""
        data = channel.encode("waiting", run=message["run"], since=message["since"], who=message["who"])
        for spoke in self.spokes:
            if spoke.index != message["index"]:
                spoke.send(data)

    def dispatch(self) -> None:
        while True:
            index, message = self.inbox.get()
            who = (message.get("host") or self.hosts[index]).split(".")[0]
            if message["m"] == "stopping":
                self.stopping.add(index)
                self.preempted(message.get("host") or self.hosts[index])
                self.halt_everywhere(index, f"{who} got SIGTERM")
            elif message["m"] == "gone" and self.in_run and index not in self.stopping:
                self.vanished.add(index)
                self.halt_everywhere(index, f"{who} left without a word (its connection dropped)")

    def halt_everywhere(self, left: int, why: str) -> None:
        """Worker `left` left the current run: the ranks of every other worker are stopped now (one pdsh round, in a
        thread: the caller is the dispatcher), and the run never starts if it has not yet. They save if every rank
        still can (a SIGTERM on every host is a preemption's joint stop); the ranks left alone would wait for the one
        that left until their rendezvous or a collective timed out (minutes)."""
        run = self.current.env[protocol.ATTEMPT_ENV["run"]] if self.current else ""
        if not self.child.cancel(run):
            return

        def stop_the_others() -> None:
            self.log(f"{why}: {run} cannot go on: stopping its ranks on every other worker")
            others = [name for i, name in enumerate(self.hosts) if i != left]
            if others:
                for line in lines(pdsh(others, [STOP_RANKS], self.env).stdout):
                    print(line, flush=True)
            self.child.terminate(run)

        threading.Thread(target=stop_the_others, name="halt", daemon=True).start()

    def run(self, attempt: Began) -> int:
        """DeepSpeed's runner over pdsh (with pdsh's env: DeepSpeed appends its port to our ssh arguments), every rank
        with the attempt's env (~/.deepspeed_env, which DeepSpeed forwards to every rank: the chart's env lines and
        the attempt's)."""
        config = host.chart_file(f"{self.env['DS_CONFIG_DIR']}/deepspeed_env") or ""
        attempt_lines = "".join(f"{key}={value}\n" for key, value in attempt.env.items())
        Tree(self.env["HOME"]).write(".deepspeed_env", config + attempt_lines, mode=0o600)
        if self.prepare() != 0:
            return 1
        run = attempt.env[protocol.ATTEMPT_ENV["run"]]
        self.log(f"{run} was halted before it started (a worker left it)" if run in self.child.cancelled else
                 f"running ({run}): {' '.join(self.command)}")
        self.vanished, self.stopping = set(), set()
        self.in_run = True
        try:
            status = self.child.run(self.command, pdsh_env({**self.env, **attempt.env}), key=run)
        finally:
            self.in_run = False
        return self.autotuned(status)

    def autotuned(self, status: int) -> int:
        """DeepSpeed's tuner exits 0 also when every experiment failed: only its optimal config means it finished."""
        results = self.env.get("DS_AUTOTUNING_RESULTS", "")
        if status != 0 or not results:
            return status
        if Tree(results).is_file("ds_config_optimal.json"):
            self.log(f"autotuning done: {results}/ds_config_optimal.json (see summary.txt beside it)")
            return 0
        self.log(f"autotuning ended without {results}/ds_config_optimal.json: no experiment succeeded (see the "
                 f"experiments' stderr.log under {results})")
        return 1

    def gather(self, attempt: Began, status: int) -> list[dict]:
        """Every worker's evidence (and its watchdog's report, to this log) in one pdsh round."""
        run = attempt.env[protocol.ATTEMPT_ENV["run"]]
        # After a stop the pod has what is left of its grace period, which the ranks' save has mostly spent.
        timeout = EVIDENCE_AFTER_STOP_S if self.stopped.is_set() else EVIDENCE_S
        try:
            done = pdsh(self.hosts, [*POD_PROGRAM, "host-evidence", run], self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.log(f"no evidence from the workers within {timeout}s: the ledger decides from the exit status")
            return []
        found, others = collect(done.stdout)
        for line in others:
            print(line, flush=True)
        # A worker whose channel dropped mid-run without a SIGTERM left: its pod killed outright, or its node lost
        # (a replacement pod may already answer pdsh above, knowing nothing of the run).
        return found + [protocol.host_evidence(self.hosts[i].split(".")[0], run, None, None, [], None, lost=True)
                        for i in sorted(self.vanished)]

    def clear(self) -> None:
        """The ranks a run left on its workers stopped (one pdsh round), but not on a worker whose pod is going away
        (its SIGTERM came over the channel, or its channel dropped mid-run): its ranks end with the pod, and once its
        network is gone pdsh would wait its whole connect timeout for it (10 s in the soak, bench/soak.py). The
        meeting clears whatever pod answers to that name next."""
        going = sorted(self.stopping | self.vanished)
        hosts = [name for i, name in enumerate(self.hosts) if i not in going]
        left_out = ", ".join(self.hosts[i].split(".")[0] for i in going[:5]) + (" ..." if len(going) > 5 else "")
        self.log("clearing ranks still running on the workers" +
                 (f" (not on {left_out}: {'its pod is' if len(going) == 1 else 'their pods are'} going away)"
                  if going else ""))
        if hosts:
            for line in lines(pdsh(hosts, [STOP_RANKS], self.env).stdout):
                print(line, flush=True)
        self.log("starting the run again, from the last complete checkpoint, if the job's failure budget allows")

    def preempted(self, who: str) -> None:
        if self.current is not None and self.ledger.mark_stopped(self.current.number, who):
            self.log(f"{who} got SIGTERM: attempt {self.current.number} is a preemption")
            self.ledger.say("stopping", STOPPED)

    def stop(self) -> None:
        self.stopped.set()
        self.preempted(host.hostname())
        if self.in_run:
            for line in lines(pdsh(self.hosts, [STOP_RANKS], self.env).stdout):
                print(line, flush=True)
        self.child.terminate()


# ---- the worker pod's agent

SSH_ENV_SKIP = re.compile(r"^(HOSTNAME|HOME|PWD|OLDPWD|SHLVL|_|TERM)$")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def ssh_environment(env, log: Log) -> str:
    """~/.ssh/environment: this container's env as the image and the chart set it (PATH, LD_LIBRARY_PATH, CUDA_*,
    the chart's valueFrom entries such as secrets), which sshd hands the ranks started over SSH
    (PermitUserEnvironment), never through a shell or a log."""
    out = []
    for name, value in env.items():
        if SSH_ENV_SKIP.match(name) or not NAME.match(name):
            continue
        if "\n" in value:
            log(f"env {name} contains a newline; sshd's environment file cannot carry it to the ranks")
            continue
        out.append(f"{name}={value}\n")
    return "".join(out)


def ssh_setup(env=os.environ) -> None:
    """~/.ssh from the mounted Secret and ConfigMap (ssh-setup.sh: keys are copied, ssh refuses readable ones)."""
    subprocess.run(["bash", f"{SCRIPTS}/ssh-setup.sh"], env=env, check=True)


def worker_agent(env=os.environ) -> int:
    """A worker pod of launchMode ssh: a non-root sshd in the foreground for the launcher's pdsh, the hang watchdog
    beside it; on SIGTERM (eviction, deletion, scale-down) the stop notice first (the launcher's spoke on this
    worker tells the ledger: a preemption), then the local ranks get SIGTERM so they can save within the pod's grace
    period, then sshd stops."""
    log = Log("worker")
    refused = ownership.claim_volume(env)  # before sshd: no rank starts on another project's checkpoints
    if refused:
        log(f"ERROR: {refused}")
        host.termination_message(last_word("failed", "config-error", refused))
        return protocol.EXIT_CONFIG_ERROR
    ssh_setup(env)
    Tree(env["HOME"]).write(".ssh/environment", ssh_environment(env, log), mode=0o600)
    port = int(env.get("DS_CHANNEL_PORT", "0") or 0)
    watchdog = Watchdog.from_env(env)
    # Listening before sshd answers: the launcher then connects. It tells this host when another's ranks wait.
    listener = channel.Listener(port, {"waiting": lambda message: watchdog.notice(
        message["run"], message["since"], message["who"])} if watchdog is not None else None) if port else None
    if watchdog is not None and listener is not None:
        watchdog.announce = lambda run, since, who: listener.broadcast(channel.encode(
            "waiting", run=run, since=since, who=who))
    peer = peercopy.start(hosts_of(f"{env['DS_CONFIG_DIR']}/hostfile"), env=env) if env.get(peercopy.PORT_ENV) \
        else None
    sshd = subprocess.Popen([host.program("sshd", "/usr/sbin/sshd"), "-D", "-e", "-f",
                             f"{env['HOME']}/.ssh/sshd_config"])
    stopping = threading.Event()
    if watchdog is not None:  # after sshd: the launcher's meeting waits for sshd, never for the watchdog
        watchdog.start(stopping)

    def stop(signum, frame) -> None:
        if stopping.is_set():
            return
        since = time.monotonic()
        stopping.set()
        log("SIGTERM: stopping local ranks")
        run = write_stop_notice(env)
        if listener is not None:
            listener.broadcast(channel.encode("stopping", host=host.hostname(), run=run))
        ranks.stop_here(env)
        if peer is not None:  # the stop's checkpoint, to the keeper, in what is left of the grace period
            peer.flush_after_stop(since, env)
        sshd.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"{host.hostname()} starting sshd on port {env.get('DS_SSH_PORT', '')}")
    sshd.wait()
    return 0


def write_stop_notice(env=os.environ) -> str:
    """protocol.STOP_NOTICE, naming the run this pod's ranks run (their DS_RUN_ID), for this host's evidence; the
    run."""
    runs = {host.environ(pid).get(protocol.ATTEMPT_ENV["run"], "") for pid in ranks.find()[1]} - {""}
    run = min(runs) if runs else ""
    state = env.get(protocol.STATE_DIR_ENV)
    if state:
        Tree(state).write(protocol.STOP_NOTICE, json.dumps({"run": run, "host": host.hostname(), "time": time.time()}))
    return run


def peer_holdings(env=os.environ) -> int:
    """`peer-holdings`, over pdsh before an attempt: what this worker can resume from, one JSON line."""
    ring = peercopy.Ring.from_env(hosts_of(f"{env['DS_CONFIG_DIR']}/hostfile"), env=env)
    if ring is None:
        print("peer-holdings: the peer copy is off here, or this host is not in the hostfile", flush=True)
        return 1
    print(json.dumps({"v": protocol.VERSION, "holds": peercopy.holdings(ring, peercopy.volume_of(env))},
                     separators=(",", ":")), flush=True)
    return 0


def peer_prepare(tag: str, peer: str, env=os.environ) -> int:
    """`peer-prepare TAG [NODE,...]`, over pdsh before the run: this worker's volume made ready for TAG, its part
    fetched from its keeper when its node is listed."""
    log = Log("peer-copy")
    ring = peercopy.Ring.from_env(hosts_of(f"{env['DS_CONFIG_DIR']}/hostfile"), env=env)
    if ring is None or not checkpoints.is_tag_name(tag):
        log("peer-prepare: the peer copy is off here, or not a tag")
        return 1
    try:
        done = peercopy.prepare(ring, peercopy.volume_of(env), tag, str(ring.node) in peer.split(","))
    except (peercopy.PeerError, OSError) as err:
        log(f"ERROR: worker {ring.node}'s volume cannot be made ready for {tag}: {err}")
        return 1
    if done:
        log(f"worker {ring.node}: {done}")
    return 0


def host_evidence(run: str) -> int:
    """`host-evidence RUN`, run on every worker over pdsh after a failed run: its watchdog's report (for the
    launcher's log) and its evidence (one JSON line)."""
    for line in lines(evidence.hang_text(run)):
        print(line, flush=True)
    found = evidence.of_run(run)
    if found:
        print(json.dumps(found, separators=(",", ":")), flush=True)
    return 0
