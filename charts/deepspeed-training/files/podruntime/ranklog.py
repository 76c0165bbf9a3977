"""Every line a rank writes, with its global rank and attempt in front: `[rank 3 attempt 2] ...`. pdsh (ssh) merges
every rank of a host into the launcher's log, and DeepSpeed's launcher (nossh) every rank of a pod into the pod's:
this is what lets `make logs RANK=N [ATTEMPT=k]` find one rank's lines there, whatever the program prints, and from
C++ too (it works on the file descriptors, not on Python's sys.stdout).

DeepSpeed's launcher runs the chart's files/rank-log.py as each rank's program (`python -u rank-log.py -m MODULE
ARGS...` or `... rank-log.py SCRIPT ARGS...`, the chart's launch command), which calls main(). It starts the
prefixer outside the rank's process tree (DeepSpeed's launcher kills a failed rank's whole tree, and the rank's last
lines must still come out; the prefixer ignores SIGTERM, SIGINT and SIGHUP and ends when the last writer closes its
pipe), points the rank's stdout and stderr at it, and then becomes the program (exec: the same process ID,
interpreter, arguments, signals and exit status). Lines are split on the newline alone (text.complete_lines, the
splitter `make logs` uses too), so no character a rank writes starts a line of another's; a carriage return inside
a line (a progress bar's redraw) keeps what a terminal would show: the text after the last one.

It is also the ledger's witness of a rank that dies of an uncaught exception before it could say so itself (a
program that never reported through train/rankstate.py): when the rank's output ends with a Python traceback, the
prefixer writes the rank's end record from its last line (protocol.END_RECORD), unless the rank wrote one for this
run itself.
"""

import json
import os
import re
import signal
import sys
import time
from collections import deque

from podruntime import host, protocol, rankstart, savehook
from podruntime.tenantfiles import Tree
from podruntime.text import complete_lines

LONGEST_LINE = 64 * 1024  # a line without its newline is written out at this length
TAIL_LINES = 40  # a traceback whose header is among the rank's last lines is how it ended,
LINES_AFTER = 10  # if no more than these follow its exception line
TORCH_PREFIX = re.compile(rb"^\[rank\d+\]: ")  # torch.distributed's excepthook puts it before every line


def tag() -> bytes:
    return protocol.rank_tag(os.environ.get("RANK", "?"), os.environ.get(protocol.ATTEMPT_ENV["attempt"], "")).encode()


def shown(line: bytes) -> bytes:
    """What a terminal shows of a line: the text after its last carriage return (a trailing one ignored)."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def prefix(read_fd: int, out_fd: int, head: bytes) -> list[bytes]:
    """Copies read_fd to out_fd line by line, each line with `head` in front, until every writer has closed it;
    returns the last TAIL_LINES lines."""
    pending, tail = b"", deque(maxlen=TAIL_LINES)
    while True:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        lines, pending = complete_lines(pending + chunk)
        if len(pending) > LONGEST_LINE:
            lines, pending = [*lines, pending], b""
        if lines:
            shown_lines = [shown(line) for line in lines]
            tail.extend(shown_lines)
            write_all(out_fd, b"".join(head + line + b"\n" for line in shown_lines))
    if pending:
        tail.append(shown(pending))
        write_all(out_fd, head + shown(pending) + b"\n")
    return list(tail)


def exception_line(tail: list[bytes]) -> str | None:
    """The exception line (`ValueError: ...`) of the traceback the output ends with (at most LINES_AFTER lines follow
    it: a message's own lines, a teardown's), or None."""
    tail = [TORCH_PREFIX.sub(b"", line) for line in tail]
    starts = [i for i, line in enumerate(tail) if line.startswith(b"Traceback (most recent call last):")]
    if not starts:
        return None
    body = tail[starts[-1] + 1:]
    for i, line in enumerate(body):
        if line[:1] not in (b" ", b"\t") and line.strip():  # the frames are indented; the exception is not
            text = line.decode("utf-8", "replace").strip()
            if len(body) - i - 1 > LINES_AFTER or not (":" in text or text.isidentifier()):
                return None
            return text
    return None


def witness(tail: list[bytes], rank_pid: int) -> None:
    """The rank's end record from the traceback its output ended with, unless it wrote its own for this run."""
    line, directory = exception_line(tail), os.environ.get(protocol.STATE_DIR_ENV)
    run, rank = os.environ.get(protocol.ATTEMPT_ENV["run"], ""), os.environ.get("RANK", "")
    if not line or not directory or not run or not rank.isdigit():
        return
    state = Tree(directory)
    name = protocol.END_RECORD.format(rank=int(rank))
    own = state.read_json(name)
    if own and own.get("run") == run:
        return
    _, fields = protocol.rank_line(state.read_text(str(rank_pid), protocol.MAX_LINE_BYTES) or "")
    step = int(fields["step"]) if fields.get("step", "").isdigit() else None
    kind, _, message = line.partition(":")
    record = protocol.end_record(run, int(rank), host.hostname(), protocol.classify_exception(
        kind.rsplit(".", 1)[-1], message), line, step, time.time())
    state.write(name, json.dumps(record))


def program_argv(argv: list[str]) -> list[str] | None:
    """The program's own command line: DeepSpeed's launcher puts `--local_rank=N` right after its user script (this
    one), where the program expects it right after its own module or script."""
    launcher = argv[:1] if argv[:1] and argv[0].startswith("--local_rank=") else []
    rest = argv[len(launcher):]
    program = rest[:2] if rest[:1] == ["-m"] else rest[:1]
    if not program or program == ["-m"]:
        return None
    return [*program, *launcher, *rest[len(program):]]


def run_prefixer(argv: list[str]) -> int:
    """`rank-prefix HEAD RANK_PID`: stdin to stdout, each line tagged; then the witness."""
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    try:
        tail = prefix(0, 1, argv[0].encode())
    except OSError:  # its reader is gone: nothing left to write to
        return 0
    try:
        witness(tail, int(argv[1]))
    except Exception:  # noqa: BLE001 - the witness is a courtesy: the ledger decides without it too
        pass
    return 0


def main(argv: list[str]) -> int:
    program = program_argv(argv)
    if program is None:
        print("usage: rank-log.py [--local_rank=N] (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        return 2
    directory = os.environ.get(protocol.STATE_DIR_ENV)
    if directory:  # what DeepSpeed's launcher gave this rank, for the loop's next start of it (rankstart.py)
        rankstart.record(Tree(directory), [sys.argv[0], *argv])
    read_fd, write_fd = os.pipe()
    rank_pid = os.getpid()  # the rank's, once this process becomes the program
    child = os.fork()
    if child == 0:  # the prefixer: a grandchild in a session of its own, outside the rank's process tree and group
        try:
            os.setsid()
            if os.fork() == 0:
                os.dup2(read_fd, 0)
                os.close(read_fd)
                os.close(write_fd)
                argv = host.pod_program("rank-prefix", tag().decode(), str(rank_pid))
                os.execv(argv[0], argv)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    os.close(read_fd)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    command = savehook.command(program)  # a plain DeepSpeed program on per-worker volumes: every node's `latest`
    os.execv(command[0], command)
    return 1  # not reached
