"""A zygote for the tests' rank processes: one interpreter that has imported torch, DeepSpeed and the train
package, and forks each rank from there. A forked rank runs `python -m train` exactly (runpy, as __main__, its
own argv, env, cwd, process group, stdout), minus the 2-3 s of imports every new interpreter pays: over the test
suite's ~100 rank start-ups, minutes. tests/support/train_run.py starts it and falls back to plain processes for a run
whose env differs in what is read at import (IMPORT_TIME_ENV). The e2e and cluster tiers start real processes.

Usage: python -u tests/support/rank_zygote.py SOCKET   (serves until its parent exits)
Protocol, one connection per rank: the client sends a JSON request {"argv", "env", "cwd", "pgid"} with its
output pipe's write end attached (SCM_RIGHTS); the zygote answers {"pid": N} once the rank is in process group
pgid (0: its own), then {"status": S} when the rank ends (S as Popen.returncode: the exit code, or -signal).
"""

import json
import os
import select
import signal
import socket
import sys
import traceback

# What these imports read from the env is fixed for every forked rank: a run that sets one of these differently
# gets a fresh interpreter instead.
IMPORT_TIME_ENV = ("DEEPSPEED_TIMEOUT", "DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "PYTHONPATH",
                   "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES")


def run_rank(request: dict, out_fd: int) -> None:
    """In the forked child: become the rank, run the program, exit with its status. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, request["pgid"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["argv"]]
        import runpy  # noqa: PLC0415 - only the child needs it

        try:
            runpy.run_module("train", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if not isinstance(done.code, int | None):
                print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child reports and exits like an interpreter would
        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit  # noqa: PLC0415

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(path: str) -> int:
    # The imports every rank would pay for, and those it pays lazily on its way to the first step: torch's
    # optimizers import dynamo at their first construction, and DeepSpeed's optimizer check imports its Muon
    # optimizer, which torch.compile()s at import (inductor): about 2.5 s of CPU per rank.
    import deepspeed  # noqa: F401, PLC0415
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401, PLC0415
    import torch  # noqa: F401, PLC0415
    import torch._dynamo  # noqa: F401, PLC0415

    import train.main  # noqa: F401, PLC0415

    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    connections: dict[int, socket.socket] = {}  # rank pid -> its client
    while os.getppid() == parent:
        readable, _, _ = select.select([server, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 512)
        while connections:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            conn = connections.pop(pid, None)
            if conn:
                try:
                    conn.sendall(json.dumps({"status": code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
        if server in readable:
            conn, _ = server.accept()
            message, fds, _, _ = socket.recv_fds(conn, 65536, 1)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                server.close()
                run_rank(request, fds[0])
            os.close(fds[0])
            # The shells' rule: parent and child both set the child's group, so the group exists when the client
            # hears the pid (the next rank joins it at once, a test signals it). The child alone raced: a second
            # rank's setpgid could run before the first rank's, fail (EPERM) and leave the first rank waiting in
            # its rendezvous until the test's timeout.
            try:
                os.setpgid(pid, request["pgid"] or pid)
            except OSError:
                pass  # the child sets it too, and reports why it cannot
            connections[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
