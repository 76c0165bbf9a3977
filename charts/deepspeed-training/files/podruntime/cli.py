"""The pod programs, one entry: `python3 -I <scripts> PROGRAM [ARGS]` in a pod (the chart's scripts directory, run
as a program: files/__main__.py), `python -m podruntime PROGRAM [ARGS]` wherever the package is installed.

  launcher DEEPSPEED_COMMAND...      launchMode ssh: the launcher pod's attempt loop (sshmode.Launcher)
  nossh-worker DEEPSPEED_COMMAND...  launchMode nossh: a worker pod's attempt loop (nosshmode.Worker)
  ssh-worker                         launchMode ssh: a worker pod's agent (sshd, the watchdog, the stop)
  sidecar [OPTIONS]                  the progress sidecar (sidecar.py)
  objectstore check|restore          the bucket's check, the restore before the ranks (objectstore.py)
  stop-ranks                         this host's ranks, stopped (ranks.py)
  watchdog                           this pod's hang watchdog alone (the loops run it as a thread)
  host-evidence RUN                  this host's evidence of RUN (evidence.py), over pdsh
  peer-holdings                      what this worker can resume from (peercopy.py), one JSON line, over pdsh
  peer-prepare TAG [NODE,...]        this worker's volume made ready for TAG (fetched from its peer when its node
                                     is listed), over pdsh
  wait-for-workers HOSTFILE TIMEOUT [INTERVAL [THEN]]   the ssh launcher's meeting, alone
  rank-prefix HEAD PID               the rank tagger's prefixer (ranklog.py starts it)
  start-ranks RUN DEEPSPEED_COMMAND...  nossh: a retry's ranks, started as DeepSpeed's launcher started them in RUN
                                     (rankstart.py; the worker's loop runs it in place of DeepSpeed's runner)

Exit status: the program's; 2 for a usage error.
"""

import os
import sys


def usage() -> int:
    print(__doc__, file=sys.stderr)
    return 2


def launcher(argv: list[str]) -> int:
    from podruntime import sshmode  # noqa: PLC0415
    from podruntime.ledger import Ledger  # noqa: PLC0415
    from podruntime.loop import AttemptLoop  # noqa: PLC0415

    if not argv:
        return usage()
    sshmode.ssh_setup()
    ledger = Ledger()
    mode = sshmode.Launcher(argv, ledger)
    return AttemptLoop(mode, ledger, mode.log).run()


def nossh_worker(argv: list[str]) -> int:
    from podruntime import nosshmode, peercopy  # noqa: PLC0415
    from podruntime.ledger import Ledger  # noqa: PLC0415
    from podruntime.loop import AttemptLoop, hosts_of  # noqa: PLC0415
    from podruntime.watchdog import Watchdog  # noqa: PLC0415

    index = os.environ.get("JOB_COMPLETION_INDEX", "")
    if not argv or not index.isdigit():
        print("nossh-worker needs JOB_COMPLETION_INDEX (the Job controller's, completionMode: Indexed) and the "
              "DeepSpeed command", file=sys.stderr)
        return 2
    import threading  # noqa: PLC0415

    watchdog = Watchdog.from_env()
    if watchdog is not None:
        watchdog.start(threading.Event())
    ledger = Ledger() if index == "0" else None
    hosts = hosts_of(f"{os.environ['DS_CONFIG_DIR']}/hostfile")
    peer = peercopy.start(hosts, int(index))
    mode = nosshmode.Worker(int(index), hosts, int(os.environ["DS_CHANNEL_PORT"]),
                            float(os.environ.get("DS_WAIT_TIMEOUT_SECONDS", "300") or 300), argv, ledger, peer=peer,
                            watchdog=watchdog)
    return AttemptLoop(mode, ledger, mode.log).run()


def wait_for_workers(argv: list[str]) -> int:
    from podruntime import sshmode  # noqa: PLC0415
    from podruntime.loop import hosts_of  # noqa: PLC0415

    if len(argv) < 2:
        return usage()
    interval = float(argv[2]) if len(argv) > 2 else 1.0
    return sshmode.Meeting(hosts_of(argv[0]), float(argv[1]), interval, argv[3] if len(argv) > 3 else "").run()


def ssh_worker(argv: list[str]) -> int:
    from podruntime import sshmode  # noqa: PLC0415

    return sshmode.worker_agent() if not argv else usage()


def sidecar(argv: list[str]) -> int:
    from podruntime import sidecar as program  # noqa: PLC0415

    return program.main(argv)


def objectstore(argv: list[str]) -> int:
    from podruntime import objectstore as program  # noqa: PLC0415

    return program.main(argv)


def stop_ranks(argv: list[str]) -> int:
    from podruntime import ranks  # noqa: PLC0415

    if argv:
        return usage()
    ranks.stop_here()
    return 0


def watchdog(argv: list[str]) -> int:
    import threading  # noqa: PLC0415

    from podruntime.watchdog import Watchdog  # noqa: PLC0415

    found = Watchdog.from_env() if not argv else None
    if found is None:
        return usage()
    found.start(threading.Event()).join()
    return 0


def host_evidence(argv: list[str]) -> int:
    from podruntime import sshmode  # noqa: PLC0415

    return sshmode.host_evidence(argv[0]) if len(argv) == 1 else usage()


def peer_holdings(argv: list[str]) -> int:
    from podruntime import sshmode  # noqa: PLC0415

    return sshmode.peer_holdings() if not argv else usage()


def peer_prepare(argv: list[str]) -> int:
    from podruntime import sshmode  # noqa: PLC0415

    return sshmode.peer_prepare(argv[0], argv[1] if len(argv) > 1 else "") if 1 <= len(argv) <= 2 else usage()


def start_ranks(argv: list[str]) -> int:
    from podruntime import rankstart  # noqa: PLC0415

    return rankstart.main(argv) if len(argv) >= 2 else usage()


def rank_prefix(argv: list[str]) -> int:
    from podruntime import ranklog  # noqa: PLC0415

    return ranklog.run_prefixer(argv) if len(argv) == 2 else usage()


# Each program imports only what it runs: a pod program starts in a fresh interpreter, often (stop-ranks and
# host-evidence over pdsh; the prefixer of every rank).
PROGRAMS = {"launcher": launcher, "nossh-worker": nossh_worker, "ssh-worker": ssh_worker, "sidecar": sidecar,
            "objectstore": objectstore, "stop-ranks": stop_ranks, "watchdog": watchdog, "host-evidence": host_evidence,
            "wait-for-workers": wait_for_workers, "rank-prefix": rank_prefix, "peer-holdings": peer_holdings,
            "peer-prepare": peer_prepare, "start-ranks": start_ranks}


# A container's entrypoint: PID 1 in its pod, which must reap orphans (host.run_as_init).
ENTRYPOINTS = {launcher, nossh_worker, ssh_worker}


def main(argv: list[str]) -> int:
    program = PROGRAMS.get(argv[0]) if argv else None
    if program is None:
        return usage()
    if program in ENTRYPOINTS:
        from podruntime import host  # noqa: PLC0415

        return host.run_as_init(lambda: program(argv[1:]))
    return program(argv[1:])
