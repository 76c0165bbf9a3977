"""This host's processes and kernel counters, as the pod programs read them: /proc (the ranks' state, command lines
and environments: the tenant's, so every read is bounded), the memory cgroup's OOM kill counter, and the container's
termination message; the chart's own ConfigMap files. The only module besides tenantfiles.py that opens files."""

import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
READ_BYTES = 1 << 20  # a /proc file of a tenant's process: at most this much
# The OOM kills the container's memory cgroup counted: cgroup v2, then v1 (runc mounts the container's own).
OOM_COUNTERS = (Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control"))
TERMINATION_LOG = "/dev/termination-log"  # the kubelet's default terminationMessagePath (mode 0666 in the container)
TERMINATION_BYTES = 4000  # the kubelet keeps 4,096


def runnable_dir() -> str | None:
    """The directory this package lies in when it runs as a program (`python3 -I DIR PROGRAM`: the chart's scripts
    directory, with its __main__.py), else None (the package installed in an environment). Not resolved: the
    kubelet mounts each key through `..data` into a directory named for its version, which another pod's mount of
    the same ConfigMap names otherwise, so only the mount's own path means the same on every host."""
    scripts = Path(os.path.abspath(__file__)).parent.parent
    return str(scripts) if (scripts / "__main__.py").is_file() else None


def pod_program(name: str, *args: str) -> list[str]:
    """Pod program `name`'s command line, run from within a pod program: the scripts directory as a program where
    this package lies in one (the chart's; -S: it needs nothing from site-packages), else the installed package."""
    scripts = runnable_dir()
    return [sys.executable, "-I", *(["-S", scripts] if scripts else ["-m", "podruntime"]), name, *args]


def runs_pod_program(argv: list[str], name: str) -> bool:
    """Whether a process's command line is pod program `name`'s as pod_program starts it."""
    return argv[1:2] == ["-I"] and argv[4:5] == [name] and argv[2:3] in (["-S"], ["-m"])


def interpreter_of(program: str) -> str | None:
    """The interpreter a script on PATH (the image's: DeepSpeed's `deepspeed`) runs in, from its first line."""
    path = shutil.which(program)
    text = _read(Path(os.path.realpath(path)), 4096) if path else None
    first = (text or b"").split(b"\n", 1)[0].decode(errors="replace")
    words = first[2:].split() if first.startswith("#!") else []
    if words[:1] == ["/usr/bin/env"] and len(words) > 1:
        words = [shutil.which(words[1]) or ""]
    return words[0] if words and os.path.isabs(words[0]) else None


def program(name: str, fallback: str) -> str:
    """A program on PATH (the image's), else where Debian puts it."""
    return shutil.which(name) or fallback


def hostname() -> str:
    return socket.gethostname()


def _read(path: Path, limit: int = READ_BYTES) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def chart_file(path: str, limit: int = READ_BYTES) -> str | None:
    """A file of the chart's own ConfigMaps (the hostfile, deepspeed_env): None when absent, unreadable or over
    `limit`. Links are followed here, unlike in tenantfiles.Tree: the kubelet mounts every ConfigMap key as a link
    through `..data` to its current version, and no tenant program writes to these read-only mounts."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit + 1)
    except OSError:
        return None
    return data.decode(errors="replace") if len(data) <= limit else None


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, ended and not yet reaped, does not)."""
    return not process_state(pid).startswith(("gone", "Z"))


def process_state(pid: int) -> str:
    """The state line of /proc/<pid>/status (`S (sleeping)`, `T (stopped)`, ...), or "gone"."""
    for line in (_read(PROC / str(pid) / "status", 4096) or b"").decode(errors="replace").splitlines():
        if line.startswith("State:"):
            return line.split(None, 1)[1]
    return "gone"


def environ(pid: int) -> dict[str, str]:
    raw = (_read(PROC / str(pid) / "environ") or b"").decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def cmdline(pid: int) -> list[str]:
    raw = (_read(PROC / str(pid) / "cmdline", 64 * 1024) or b"").decode(errors="replace")
    return [word for word in raw.split("\0") if word]


@dataclass
class Process:
    pid: int
    ppid: int
    uid: int
    argv: list[str]


def _stat(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...: field N of proc(5) at N - 3), or [] once
    it is gone (the name, in parentheses, may hold spaces and parentheses of its own)."""
    stat = (_read(PROC / str(pid) / "stat", 4096) or b"").decode(errors="replace")
    return stat.rsplit(")", 1)[1].split() if ")" in stat else []


def processes(uid: int | None = None) -> list[Process]:
    """Every process of this host (its PID namespace), of `uid` if given."""
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            info = entry.stat()
        except OSError:
            continue
        if uid is not None and info.st_uid != uid:
            continue
        try:
            ppid = int(_stat(entry.name)[1])
        except (IndexError, ValueError):
            continue
        found.append(Process(int(entry.name), ppid, info.st_uid, cmdline(int(entry.name))))
    return found


@dataclass(frozen=True)
class Usage:
    """What one process has done so far, from two small /proc reads: its state letter (R, S, D, T, ...), the CPU
    time of all its threads in clock ticks, and the bytes it moved through read/write system calls (rchar + wchar:
    files, pipes and sockets read with read(); None where /proc/<pid>/io is not ours to read)."""
    state: str
    cpu_ticks: int
    io_bytes: int | None


TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def usage(pid: int) -> Usage | None:
    """`pid`'s Usage, or None once it is gone."""
    fields = _stat(pid)
    try:
        state, ticks = fields[0], int(fields[11]) + int(fields[12])  # utime + stime
    except (IndexError, ValueError):
        return None
    io = {}
    for line in (_read(PROC / str(pid) / "io", 4096) or b"").decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        io[name] = value.strip()
    moved = (int(io["rchar"]) + int(io["wchar"])) if io.get("rchar", "").isdigit() and io.get(
        "wchar", "").isdigit() else None
    return Usage(state, ticks, moved)


def descendants(roots: list[int]) -> dict[int, list[int]]:
    """Each root pid's processes: itself and every process below it (its data loader's workers, a compiler), from one
    pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            children.setdefault(int(_stat(entry.name)[1]), []).append(int(entry.name))
        except (IndexError, ValueError):
            continue
    found = {}
    for root in roots:
        tree, todo = [], [root]
        while todo and len(tree) < 4096:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(children.get(pid, ()))
        found[root] = tree
    return found


def oom_kills() -> int | None:
    """The OOM kills this container's memory cgroup has counted, or None where it counts none."""
    for path in OOM_COUNTERS:
        for line in (_read(path, 4096) or b"").decode(errors="replace").splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def run_as_init(program: Callable[[], int]) -> int:
    """`program`'s exit status. As a container's PID 1 it runs in a child, and this process does what an init does:
    passes SIGTERM, SIGINT and SIGHUP on to it, and reaps every process that ends orphaned in the container (a rank
    whose DeepSpeed launcher died, a launcher whose SSH session closed, every rank tagger's prefixer), which would
    otherwise stay zombies that look alive to anything that waits for them."""
    if os.getpid() != 1:
        return program()
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        status = 1
        try:
            status = program()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: os.kill(child, signum))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


def termination_message(text: str) -> None:
    """The container's last word (`kubectl describe`, `make why`); nothing outside a container (none to write)."""
    try:
        fd = os.open(TERMINATION_LOG, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(fd, (text[:TERMINATION_BYTES] + "\n").encode())
    except OSError:
        pass
    finally:
        os.close(fd)
