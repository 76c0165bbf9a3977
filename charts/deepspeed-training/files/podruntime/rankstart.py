"""A retry's ranks started by the attempt loop itself (nossh), as DeepSpeed's launcher started them in this pod's
last run: the same interpreter, command line and environment, without the two interpreters that DeepSpeed's runner
(`deepspeed`) and launcher (launch.py) each spend importing torch and DeepSpeed before the first rank starts, and
without their way out (launch.py looks at its ranks once a second, then both interpreters tear down).

- The record: every rank's files/rank-log.py writes, before it becomes the program, what DeepSpeed's launcher gave
  it (`record`): the interpreter, its command line and the launcher's own variables (LAUNCHER_ENV), as
  LAUNCH_RECORD in the pod's state directory. The ranks can write there too: a record is read as hostile input
  (tenantfiles.Tree, bounded) and used only when it agrees, field by field, with what the loop itself would have
  DeepSpeed start (`plan`): every local rank once, this node's rank, one world, the master the command names, the
  command line launch.py builds from the loop's command (rank-log.py, `--local_rank=N`, the program), from a run
  this pod ran. Anything else, and a pod's first run, is DeepSpeed's runner as always, with the reason in the log.
- The environment: the run's (the pod's, with the attempt's keys) plus the launcher's variables. In nossh that is
  exactly what DeepSpeed gives a rank: its runner passes its own environment through unchanged (runner.py main(),
  the `--no_ssh` branch) and launch.py adds LAUNCHER_ENV (main()). Runner arguments that change a rank's command
  or environment otherwise (core binding, per-rank log files, `--no_python`, `--module`) keep DeepSpeed's runner.
- The supervision (`supervise`) is launch.py's (main(), sigkill_handler): when a rank ends with a non-zero status,
  the others' process trees get SIGTERM, SIGKILL after KILL_AFTER_S, and the starter exits with that status as
  launch.py does (a signal's death as 256 - N); on SIGTERM or SIGINT it does the same and exits 1.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from podruntime import host, protocol
from podruntime.tenantfiles import Tree
from podruntime.text import Log

# The env DeepSpeed's launcher sets for every rank (deepspeed/launcher/launch.py main(), 0.19.8; tests/test_chart.py
# reads launch.py's source for it): a value the user set would be replaced, or, set in a way the launcher does not
# see, would disagree with it. (It also sets OMP_NUM_THREADS, only with --bind_cores_to_rank.) CUDA_VISIBLE_DEVICES
# comes through the accelerator's set_visible_devices_envs(), which the cuda and cpu accelerators implement with it.
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "RANK",
                "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
# What importing DeepSpeed sets in its own environment (deepspeed/__init__.py, os.environ.setdefault; a test reads
# the source): its runner and launcher import it, so every rank they start inherits it; the starter does not.
IMPORT_ENV = ("PYTORCH_NVML_BASED_CUDA_CHECK",)
RECORDED_ENV = (*LAUNCHER_ENV, *IMPORT_ENV)
NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() takes "²", which int() refuses
LAUNCH_RECORD = "launch-{local_rank}.json"  # in the pod's state directory (protocol.STATE_DIR_ENV)
RANK_LOG = "rank-log.py"  # the chart's rank program (files/rank-log.py), first word of the program in the command
PROGRAM = "start-ranks"  # the starter's name as a pod program (cli.py)
# DeepSpeed runner arguments that leave a rank's command line and environment as `plan` rebuilds them (the rest
# change them: --bind_cores_to_rank, --enable_each_rank_log, --no_python, --module, --autotuning, ...).
KEPT_RUNNER_ARGS = ("--hostfile", "--include", "--exclude", "--num_nodes", "--num_gpus", "--master_addr",
                    "--master_port", "--no_ssh", "--node_rank", "--no_ssh_check", "--force_multi", "--launcher",
                    "--launcher_args", "--ssh_port", "--no_local_rank", "--quiet", "--log_level", "-q")
MAX_VALUE_CHARS = 4096
POLL_S = 0.1
KILL_AFTER_S = 30  # launch.py's terminate_process_tree waits as long before SIGKILL


@dataclass
class RankStart:
    python: str
    argv: list[str]  # rank-log.py and its arguments, as launch.py gave them
    env: dict[str, str]  # the launcher's variables only

    def command(self) -> list[str]:
        return [self.python, "-u", *self.argv]


def record(state: Tree, argv: list[str], env=os.environ) -> None:
    """rank-log.py's record of what DeepSpeed's launcher gave this rank (nothing when no launcher set LOCAL_RANK)."""
    local_rank = env.get("LOCAL_RANK", "")
    if not NUMBER.fullmatch(local_rank):
        return
    state.write(LAUNCH_RECORD.format(local_rank=int(local_rank)), json.dumps({
        "run": env.get(protocol.ATTEMPT_ENV["run"], ""), "python": sys.executable, "argv": argv,
        "env": {key: env[key] for key in RECORDED_ENV if key in env}}))


def split_command(command: list[str]) -> tuple[dict[str, str], list[str]] | str:
    """({runner argument: value}, the program after rank-log.py) of the loop's `deepspeed` command, or why the
    starter cannot rebuild what DeepSpeed's launcher would run for it."""
    at = next((i for i, word in enumerate(command) if os.path.basename(word) == RANK_LOG), None)
    if at is None:
        return f"the command runs no {RANK_LOG}"
    runner: dict[str, str] = {}
    words = command[1:at]
    i = 0
    while i < len(words):
        name, eq, value = words[i].partition("=")
        if name not in KEPT_RUNNER_ARGS:
            return f"DeepSpeed's runner argument {name} changes how a rank starts"
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
            value, i = words[i + 1], i + 1
        runner[name] = value
        i += 1
    return runner, command[at:]


def _text(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_VALUE_CHARS and "\0" not in value


def plan(state: Tree | None, command: list[str], node: int, runs) -> tuple[str, list[RankStart]] | str:
    """(the run the records are of, each local rank's start) from this pod's records, or why not (the runner then)."""
    if state is None:
        return "the pod has no state directory"
    split = split_command(command)
    if isinstance(split, str):
        return split
    runner, program = split
    first = state.read_json(LAUNCH_RECORD.format(local_rank=0))
    if first is None:
        return "no rank of this pod's last run recorded its start"
    local_size = (first.get("env") or {}).get("LOCAL_SIZE") if isinstance(first.get("env"), dict) else None
    if not (isinstance(local_size, str) and NUMBER.fullmatch(local_size) and 0 < int(local_size) <= 1024):
        return "local rank 0's record has no LOCAL_SIZE"
    starts, ranks, shared, python = [], set(), None, host.interpreter_of(command[0])
    for local_rank in range(int(local_size)):
        found = first if local_rank == 0 else state.read_json(LAUNCH_RECORD.format(local_rank=local_rank))
        why = _disagrees(found, local_rank, node, runner, program, runs, python)
        if why:
            return f"local rank {local_rank}'s record {why}"
        env = found["env"]
        world = {key: env.get(key) for key in ("WORLD_SIZE", "CROSS_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        same = (found["run"], found["python"], json.dumps(world, sort_keys=True))
        if shared is not None and same != shared:
            return f"local rank {local_rank}'s record is of another run, interpreter or world than local rank 0's"
        shared = same
        if int(env["RANK"]) >= int(env["WORLD_SIZE"]) or int(env["RANK"]) in ranks:
            return f"local rank {local_rank}'s record has RANK {env['RANK']} twice or outside the world"
        ranks.add(int(env["RANK"]))
        starts.append(RankStart(found["python"], found["argv"], env))
    return shared[0], starts


def _disagrees(found, local_rank: int, node: int, runner: dict[str, str], program: list[str], runs,
               python: str | None) -> str:
    """Why a rank's record is not what DeepSpeed's launcher gives that rank for the loop's command ("" when it is)."""
    if not isinstance(found, dict) or set(found) != {"run", "python", "argv", "env"}:
        return "is missing or not a launch record"
    env = found["env"]
    if not (isinstance(env, dict) and set(env) <= set(RECORDED_ENV) and all(map(_text, env.values()))
            and set(LAUNCHER_ENV) <= set(env)):
        return "does not hold the launcher's variables"
    if not (_text(found["run"]) and found["run"] in runs):
        return "is of no run this pod ran"
    if found["python"] != python:
        return f"names another interpreter than DeepSpeed's runner's ({python or 'unknown'})"
    local = [] if "--no_local_rank" in runner else [f"--local_rank={local_rank}"]
    if found["argv"] != [program[0], *local, *program[1:]]:
        return "has another command line than the loop's"
    expected = {"LOCAL_RANK": str(local_rank), "CROSS_RANK": str(node), "MASTER_ADDR": runner.get("--master_addr"),
                "MASTER_PORT": runner.get("--master_port")}
    for key, value in expected.items():
        if value is not None and env.get(key) != value:
            return f"has {key}={env.get(key)} where the loop's command means {value}"
    if not all(NUMBER.fullmatch(env[key]) for key in ("WORLD_SIZE", "CROSS_SIZE", "LOCAL_SIZE", "RANK")):
        return "has a size or rank that is not a number"
    return ""


# ---- the starter: `start-ranks RUN DEEPSPEED_COMMAND...` (cli.py), in place of DeepSpeed's runner and launcher


def end_trees(pids: list[int]) -> None:
    """launch.py's terminate_process_tree for every rank: SIGTERM to each rank and every process below it, then
    SIGKILL to those still there after KILL_AFTER_S."""
    trees = [pid for tree in host.descendants(pids).values() for pid in tree]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in trees:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        until = time.monotonic() + KILL_AFTER_S
        while time.monotonic() < until and any(host.alive(pid) for pid in trees):
            time.sleep(POLL_S)


def supervise(starts: list[RankStart], base_env, log: Log) -> int:
    """Starts every rank and waits for them as launch.py does; its exit status. The signal handler only says a stop
    came (it may interrupt a wait on a rank, whose lock is not re-entrant); this loop ends the ranks."""
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    processes = []
    for start in starts:
        if stop:
            break
        processes.append(subprocess.Popen(start.command(), env={**base_env, **start.env}))
    log(f"started ranks {' '.join(s.env['RANK'] for s in starts)} (pids {' '.join(str(p.pid) for p in processes)})")
    failed = None  # the status of the first rank that ended with one, launch.py's last_return_code
    alive = list(processes)
    while alive and not stop and failed is None:
        for p in list(alive):
            status = p.poll()
            if status is not None:
                alive.remove(p)
                if status != 0:
                    failed = status
                    log(f"rank pid {p.pid} exited with status {status}: ending the others")
                    break
        else:
            time.sleep(POLL_S)
    end_trees([p.pid for p in processes if p.poll() is None])
    for p in processes:
        p.wait()
    if failed is not None:
        return failed % 256  # launch.py's sys.exit(returncode): a signal N's death is 256 - N
    return 1 if stop else 0


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        return 2
    run, command = argv[0], argv[1:]
    log = Log(f"start-ranks {host.hostname()}")
    node = next((w.split("=", 1)[1] for w in command if w.startswith("--node_rank=")), "")
    state = os.environ.get(protocol.STATE_DIR_ENV)
    found = plan(Tree(state) if state else None, command, int(node) if NUMBER.fullmatch(node) else -1, {run})
    if isinstance(found, str):  # changed since the loop read them: DeepSpeed's runner, as on a first run
        log(f"DeepSpeed's runner starts the ranks ({found})")
        try:
            os.execvp(command[0], command)
        except OSError as err:
            log(f"cannot start {command[0]}: {err.strerror}")
            return 127
    return supervise(found[1], os.environ, log)
