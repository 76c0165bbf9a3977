"""What this host knows of how an attempt ended, for the ledger's owner (protocol.host_evidence): its watchdog's
hang report, its ranks' end records, the last step rank 0 published (if rank 0 is here), the OOM kills its memory
cgroup counted, and whether its pod got SIGTERM. All read from the pod's state directory through tenantfiles.Tree
(the ranks write there), typed and bounded."""

import os

from podruntime import host, protocol
from podruntime.tenantfiles import Tree

MAX_END_RECORDS = 64


def state_tree(env=os.environ, log=None) -> Tree | None:
    directory = env.get(protocol.STATE_DIR_ENV)
    return Tree(directory, log) if directory else None


def of_run(run: str, status: int | None = None, env=os.environ, returned: float | None = None) -> dict | None:
    """This host's evidence of `run`, or None (no state directory, or no run ID); `returned`: when this host's
    DeepSpeed launcher exited, where it ran here."""
    state = state_tree(env)
    if state is None or not protocol.parse_run_id(run):
        return None
    hang = protocol.valid_hang_report(state.read_json(protocol.HANG_JSON.format(run=run)))
    ends = []
    for name in state.names(pattern=protocol.END_RECORD_NAME, limit=MAX_END_RECORDS):
        record = protocol.valid_end_record(state.read_json(name))
        if record and record["run"] == run:
            ends.append(record)
    progress = state.read_json(protocol.PROGRESS) or {}
    step = progress.get("step") if progress.get("run") == run else None
    notice = state.read_json(protocol.STOP_NOTICE) or {}
    return protocol.valid_host_evidence(protocol.host_evidence(
        host.hostname(), run, status, hang, ends, step, host.oom_kills(), stopped=notice.get("run") == run,
        returned=returned))


def hang_text(run: str, env=os.environ) -> str:
    """The watchdog's report of `run` for a person (its HANG_TEXT), or ""."""
    state = state_tree(env)
    if state is None or not protocol.parse_run_id(run):
        return ""
    return state.read_text(protocol.HANG_TEXT.format(run=run), 64 * 1024) or ""
