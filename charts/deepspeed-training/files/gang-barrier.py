"""Start barrier of launchMode nossh: before every run, all workers meet on worker 0, so a run never mixes ranks
of different attempts (a rank of a new attempt would otherwise join the rendezvous of a rank 0 still stuck in
the failed one). A worker reaches the barrier only when its own ranks are gone; worker 0 serves it only
between runs, so when everyone has joined, every rank of the previous run is gone.

Worker 0 also owns the job's ledger of attempts (attempts.py): when everyone is here it decides why the last
attempt ended from every worker's evidence of it (each brings its own: its DeepSpeed launcher's exit status, its
watchdog's hang report, its ranks' end records), then begins the next attempt, or, when a stop rule ends the job
(the failure budget spent, the same error twice, no progress), ends every worker.

Usage: gang-barrier.py INDEX PORT TIMEOUT_SECONDS HOST...   (the hostfile's hosts, worker 0 first)
Worker 0 listens on PORT; the others connect, send "JOIN <index> [<evidence JSON>]" and wait for "GO KEY=VALUE..."
(the attempt's env: attempts.ENV_KEYS, its name DS_RUN_ID, for the hang watchdog's diagnostics/<run>, its number and
budget used, which every worker writes to the state directory's attempt.env for its ranks) or "END <cause>" (a stop
rule ends the job). DS_LAST_STATUS: this worker's last run's exit status (nossh-worker.sh), part of its evidence.
Exits 0 when all workers met, attempts.NOT_RETRIED after END, 1 at the deadline naming the workers still missing.
Standard library only: it runs before every attempt.
"""

import json
import os
import re
import select
import socket
import sys
import time
from pathlib import Path

import attempts  # beside this script
import podstate  # the chart's copy of train/podstate.py (attempts.py put it on the path)

LOG_EVERY_S = 5
LINE_BYTES = podstate.MAX_RECORD_BYTES + 64  # a JOIN line, with its evidence
RETRY_S = 0.25  # a refused connection costs nothing; the run starts as soon as worker 0 listens


def log(index: int, message: str) -> None:
    print(f"gang-barrier {index}: {message}", flush=True)


def record_attempt(env: dict[str, str]) -> None:
    """DS_RANK_STATE_DIR/attempt.env: the attempt's KEY=VALUE lines, which nossh-worker.sh exports."""
    directory = os.environ.get("DS_RANK_STATE_DIR")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, podstate.ATTEMPT_ENV_FILE).write_text("".join(f"{k}={v}\n" for k, v in env.items()))


def last_evidence() -> dict | None:
    """This worker's evidence of its last run (attempts.evidence), with its exit status (DS_LAST_STATUS)."""
    directory = os.environ.get(podstate.STATE_DIR_ENV)
    if not directory:
        return None
    found = podstate.StateDir(Path(directory)).read(podstate.ATTEMPT_ENV_FILE, 4096)
    env = dict(line.split("=", 1) for line in (found[0].decode(errors="replace") if found else "").splitlines()
               if "=" in line)
    status = os.environ.get("DS_LAST_STATUS", "")
    return attempts.evidence(env.get(podstate.ATTEMPT_ENV["run"], ""), int(status) if status.isdigit() else None)


def parse_go(words: list[str]) -> dict[str, str] | None:
    """The env of a GO line: only attempts.ENV_KEYS, values without shell or whitespace characters."""
    env = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    if words[:1] != ["GO"] or set(env) != set(attempts.ENV_KEYS):
        return None
    if not all(re.fullmatch(r"[A-Za-z0-9_./-]+", v) for v in env.values()):
        return None
    return env


def listen(port: int) -> socket.socket:
    """IPv4 and IPv6 where the pod has both, else IPv4 (SO_REUSEADDR: the barrier reopens after every run)."""
    try:
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError):
        return socket.create_server(("", port))


def serve(port: int, deadline: float, hosts: list[str]) -> int:
    waiting = {i: host for i, host in enumerate(hosts) if i != 0}
    joined: dict[int, socket.socket] = {}
    reports: dict[int, dict] = {}  # the workers' evidence of the last run
    partial: dict[socket.socket, bytes] = {}
    server = listen(port)
    log(0, f"waiting up to {deadline - time.monotonic():.0f}s for {len(waiting)} workers on port {port}")
    next_log = time.monotonic() + LOG_EVERY_S
    try:
        while True:
            missing = sorted(set(waiting) - set(joined))
            if not missing:
                attempts.record_evidence([r for r in (last_evidence(), *reports.values()) if r])
                env, line, cause = attempts.begin()
                if env is not None:
                    record_attempt(env)
                message = f"GO {' '.join(f'{k}={v}' for k, v in env.items())}\n" if env else f"END {cause}\n"
                for conn in joined.values():
                    try:
                        conn.sendall(message.encode())
                    except OSError:
                        pass  # it left just now: the run's rendezvous will tell
                if env is None:
                    log(0, line)
                    return attempts.NOT_RETRIED
                log(0, f"all {len(hosts)} workers are here: starting the run, {line}")
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
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if sock in partial:
                    partial[sock] += data
                    if data and b"\n" not in partial[sock] and len(partial[sock]) < LINE_BYTES:
                        continue
                    line = partial.pop(sock).split(b"\n")[0].decode(errors="replace").split(" ", 2)
                    index = int(line[1]) if len(line) >= 2 and line[0] == "JOIN" and line[1].isdigit() else -1
                    if index in waiting:
                        if index in joined:
                            joined[index].close()  # a reconnect of the same worker
                        joined[index] = sock
                        try:
                            report = podstate.valid_host_evidence(json.loads(line[2])) if len(line) == 3 else None
                        except ValueError:
                            report = None
                        if report:
                            reports[index] = report
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
    report = last_evidence()
    hello = f"JOIN {index}" + (f" {json.dumps(report, separators=(',', ':'))}" if report else "") + "\n"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host0, port), timeout=2) as conn:
                conn.sendall(hello.encode())
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                answer = b""
                while not answer.endswith(b"\n") and len(answer) < 4096:
                    data = conn.recv(4096)
                    if not data:
                        break
                    answer += data
                words = answer.decode(errors="replace").split()
                if words[:1] == ["END"]:
                    cause = words[1] if len(words) == 2 and words[1] in podstate.CAUSES else "a stop rule"
                    log(index, f"worker 0 says the job stops ({cause}: its log says why): failing the job")
                    return attempts.NOT_RETRIED
                env = parse_go(words)
                if env is not None:
                    record_attempt(env)
                    log(index, "all workers are here: starting the run")
                    return 0
                reason = ("worker 0 sent an answer this worker does not understand" if words else
                          "worker 0 closed the barrier before everyone arrived")
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
