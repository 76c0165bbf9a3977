"""Every line a rank writes, with its global rank and attempt in front: `[rank 3 attempt 2] ...`. pdsh (ssh) merges
every rank of a host into the launcher's log, and DeepSpeed's launcher (nossh) every rank of a pod into the pod's:
this is what lets `make logs RANK=N [ATTEMPT=k]` find one rank's lines there, whatever the program prints, and from
C++ too (it works on the file descriptors, not on Python's sys.stdout).

DeepSpeed's launcher runs it as each rank's program (`python -u rank-log.py -m MODULE ARGS...` or
`python -u rank-log.py SCRIPT ARGS...`, the chart's launch command). It starts the prefixer outside the rank's process
tree (DeepSpeed's launcher kills a failed rank's whole tree, and the rank's last lines must still come out; the
prefixer ignores SIGTERM, SIGINT and SIGHUP and ends when the last writer closes its pipe), points the rank's stdout
and stderr at it, and then becomes the program (exec: the same process ID, interpreter, arguments, signals and exit
status). A carriage return inside a line (a progress bar's redraw) keeps what a terminal would show: the text after
the last one. Standard library only.

Usage: python -u rank-log.py [--local_rank=N] (-m MODULE | SCRIPT) [ARGS...]
       (RANK and --local_rank from DeepSpeed's launcher, DS_ATTEMPT from the chart's ledger)
"""

import os
import signal
import sys

LONGEST_LINE = 64 * 1024  # a line without its newline is written out at this length


def tag() -> bytes:
    rank, attempt = os.environ.get("RANK", "?"), os.environ.get("DS_ATTEMPT", "")
    return f"[rank {rank}{f' attempt {attempt}' if attempt.isdigit() else ''}] ".encode()


def shown(line: bytes) -> bytes:
    """What a terminal shows of a line: the text after its last carriage return (a trailing one ignored)."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def prefix(read_fd: int, out_fd: int, head: bytes) -> None:
    """Copies read_fd to out_fd line by line, each line with `head` in front, until every writer has closed it."""
    pending = b""
    while True:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > LONGEST_LINE:
            lines, pending = [*lines, pending], b""
        if lines:
            write_all(out_fd, b"".join(head + shown(line) + b"\n" for line in lines))
    if pending:
        write_all(out_fd, head + shown(pending) + b"\n")


def program_argv(argv: list[str]) -> list[str] | None:
    """The program's own command line: DeepSpeed's launcher puts `--local_rank=N` right after its user script (this
    one), where the program expects it right after its own module or script."""
    launcher = [a for a in argv if a.startswith("--local_rank=")][:1] if argv[:1] and argv[0].startswith(
        "--local_rank=") else []
    rest = argv[len(launcher):]
    program = rest[:2] if rest[:1] == ["-m"] else rest[:1]
    if not program or program == ["-m"]:
        return None
    return [*program, *launcher, *rest[len(program):]]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--prefix"] and len(argv) == 2:  # the prefixer: stdin to stdout, each line tagged
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(stop, signal.SIG_IGN)
        try:
            prefix(0, 1, argv[1].encode())
        except OSError:  # its reader is gone: nothing left to write to
            pass
        return 0
    program = program_argv(argv)
    if program is None:
        print(__doc__, file=sys.stderr)
        return 2
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # the prefixer: a grandchild in a session of its own, outside the rank's process tree and group,
        try:  # and a program of its own (nothing that finds ranks by their command line finds it)
            os.setsid()
            if os.fork() == 0:
                os.dup2(read_fd, 0)
                os.close(read_fd)
                os.close(write_fd)
                os.execv(sys.executable, [sys.executable, "-I", "-S", os.path.abspath(__file__), "--prefix",
                                          tag().decode()])
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    os.close(read_fd)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    os.execv(sys.executable, [sys.executable, "-u", *program])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
