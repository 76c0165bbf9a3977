"""Start barrier of launchMode nossh: before every run, all workers meet on worker 0, so a run never mixes ranks
of different attempts (a rank of a new attempt would otherwise join the rendezvous of a rank 0 still stuck in
the failed one). A worker reaches the barrier only when its own ranks are gone; worker 0 serves it only
between runs, so when everyone has joined, every rank of the previous run is gone.

Usage: gang-barrier.py INDEX PORT TIMEOUT_SECONDS HOST...   (the hostfile's hosts, worker 0 first)
Worker 0 listens on PORT; the others connect, send "JOIN <index>" and wait for "GO <run>": the attempt's name,
which every worker writes to DS_RANK_STATE_DIR/run-id for its ranks (DS_RUN_ID: the hang watchdog's
diagnostics/<run>). Exits 0 when all workers met, 1 at the deadline naming the workers still missing. Standard
library only: it runs before every attempt.
"""

import os
import select
import socket
import sys
import time
from pathlib import Path

LOG_EVERY_S = 5
RETRY_S = 0.25  # a refused connection costs nothing; the run starts as soon as worker 0 listens


def log(index: int, message: str) -> None:
    print(f"gang-barrier {index}: {message}", flush=True)


def record_run(run: str) -> None:
    directory = os.environ.get("DS_RANK_STATE_DIR")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, "run-id").write_text(run)


def listen(port: int) -> socket.socket:
    """IPv4 and IPv6 where the pod has both, else IPv4 (SO_REUSEADDR: the barrier reopens after every run)."""
    try:
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError):
        return socket.create_server(("", port))


def serve(port: int, deadline: float, hosts: list[str]) -> int:
    waiting = {i: host for i, host in enumerate(hosts) if i != 0}
    joined: dict[int, socket.socket] = {}
    partial: dict[socket.socket, bytes] = {}
    server = listen(port)
    log(0, f"waiting up to {deadline - time.monotonic():.0f}s for {len(waiting)} workers on port {port}")
    next_log = time.monotonic() + LOG_EVERY_S
    try:
        while True:
            missing = sorted(set(waiting) - set(joined))
            if not missing:
                run = time.strftime("run-%Y%m%dT%H%M%SZ", time.gmtime())
                record_run(run)
                for conn in joined.values():
                    try:
                        conn.sendall(f"GO {run}\n".encode())
                    except OSError:
                        pass  # it left just now: the run's rendezvous will tell
                log(0, f"all {len(hosts)} workers are here: starting the run")
                return 0
            now = time.monotonic()
            if now >= deadline:
                log(0, f"ERROR: {len(missing)} of {len(hosts)} workers did not reach the start barrier:")
                for i in missing[:20]:
                    log(0, f"  {hosts[i]}")
                return 1
            if now >= next_log:
                shown = ", ".join(hosts[i].split(".")[0] for i in missing[:5])
                more = f" ... (+{len(missing) - 5} more)" if len(missing) > 5 else ""
                log(0, f"{len(hosts) - len(missing)}/{len(hosts)} here; waiting for {shown}{more} "
                       f"({deadline - now:.0f}s left)")
                next_log = now + LOG_EVERY_S
            readable, _, _ = select.select([server, *partial, *joined.values()], [], [], 1.0)
            for sock in readable:
                if sock is server:
                    conn, _ = server.accept()
                    partial[conn] = b""
                    continue
                try:
                    data = sock.recv(256)
                except OSError:
                    data = b""
                if sock in partial:
                    partial[sock] += data
                    if data and b"\n" not in partial[sock] and len(partial[sock]) < 256:
                        continue
                    line = partial.pop(sock).split(b"\n")[0].decode(errors="replace").split()
                    index = int(line[1]) if len(line) == 2 and line[0] == "JOIN" and line[1].isdigit() else -1
                    if index in waiting:
                        if index in joined:
                            joined[index].close()  # a reconnect of the same worker
                        joined[index] = sock
                    else:
                        sock.close()
                else:  # a joined worker sent more or hung up: it is gone (its pod stopped)
                    for i, conn in list(joined.items()):
                        if conn is sock:
                            del joined[i]
                    sock.close()
    finally:
        for sock in [*joined.values(), *partial]:
            sock.close()
        server.close()


def join(index: int, port: int, deadline: float, host0: str) -> int:
    next_log, reason = time.monotonic() + LOG_EVERY_S, "not tried yet"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host0, port), timeout=2) as conn:
                conn.sendall(f"JOIN {index}\n".encode())
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                answer = conn.recv(64).decode(errors="replace").split()
                if answer[:1] == ["GO"]:
                    record_run(answer[1] if len(answer) == 2 and answer[1].isprintable() else "run")
                    log(index, "all workers are here: starting the run")
                    return 0
                reason = "worker 0 closed the barrier before everyone arrived"
        except OSError as err:
            reason = err.strerror or str(err)
        if time.monotonic() >= next_log:
            log(index, f"waiting for worker 0 ({host0}:{port}) to open the start barrier: {reason} "
                       f"({deadline - time.monotonic():.0f}s left)")
            next_log = time.monotonic() + LOG_EVERY_S
        time.sleep(RETRY_S)
    log(index, f"ERROR: no start barrier on worker 0 ({host0}:{port}) within the timeout: {reason}")
    return 1


def main(argv: list[str]) -> int:
    index, port, timeout, hosts = int(argv[0]), int(argv[1]), float(argv[2]), argv[3:]
    deadline = time.monotonic() + timeout
    if index == 0:
        return serve(port, deadline, hosts)
    return join(index, port, deadline, hosts[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
