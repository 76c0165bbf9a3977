"""The fault drill: one real fault per case, in both launch modes and two programs (the train package, through
tests/e2e/fault_probe.py, and the Hugging Face Trainer example), on the namespace hosts (tests/support/harness.py):
the cause the ledger records for the attempt the fault ended, and the job's stop where a stop rule applies, against
the expected. `make drill-faults` runs every case (DS_DRILLS=faults) and prints the table; `make test` runs the cases
marked for CI. The causes whose evidence only the API server has (OOM, eviction, deletion, a lost node's pods) are
the cluster tier's (tests/cluster/test_cluster.py), where `make why` reads them.

Each case: (name, mode, program, fault, what it expects: attempt 1's cause, and the job's end)."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.test_byo_programs import trainer_values
from tests.support.chart_pods import REASON, e2e_values, render
from tests.support.harness import Claims, Cluster, wait, wait_for
from tests.support.train_run import cpu_ds_config

ALL = "faults" in os.environ.get("DS_DRILLS", "")
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
RESULTS: list[tuple[str, str, str, bool]] = []


@dataclass
class Case:
    name: str
    mode: str  # ssh | nossh
    program: str  # train | trainer
    fault: str  # what the drill does (see inject)
    cause: str  # attempt 1's cause, as the ledger records it
    job: str = "completed"  # the job's end: the verdict's cause ("completed": it finished)
    words: str = ""  # in attempt 1's reason
    env: dict = field(default_factory=dict)  # the program's fault (fault_probe.py)
    values: dict = field(default_factory=dict)  # what the case changes in the chart's values
    ci: bool = False  # run by `make test` too

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.program}-{self.name}"


HANG = {"hangDetection": {"enabled": True, "startupSeconds": 120, "stepSeconds": 10, "checkpointSeconds": 10}}
# The collective timeout (1 min, the e2e values') below the hang budget, and the signals off (they find a blocked
# rank in 20 s): the timeout comes first.
TIMEOUT_FIRST = {"hangDetection": {"enabled": True, "startupSeconds": 300, "stepSeconds": 100,
                                   "checkpointSeconds": 100, "signalSeconds": 0}}
# The values' claim removed (per-worker emptyDirs, the peer copy on), and a run long enough to lose a pod in it.
DEFAULT_STORAGE = {"checkpoints": None, "train": {"config": {"steps": 300}}}
LONG_TRAINER = {"train": {"args": ["--max_steps=300"]}}
NAN = {"deepspeed": {"config": cpu_ds_config(stage=2, micro=4, gradient_clipping=0.0, optimizer={
    "type": "AdamW", "params": {"lr": 1e30, "weight_decay": 0.0, "torch_adam": True}})}}


def train_cases(mode: str) -> list[Case]:
    return [
        Case("completes", mode, "train", "none", "completed"),
        Case("kill-9", mode, "train", "kill", "program-error", words="was killed by SIGKILL"),
        Case("sigstop", mode, "train", "stop", "hang", words="its process is stopped", values=HANG),
        Case("blocked-read", mode, "train", "program", "hang", words="stuck outside any collective",
             env={"FAULT": "block", "FAULT_STEP": "25"}, values=HANG),
        # Rank 1 blocked outside any collective (a dead mount) with the hang budget above the collective timeout:
        # rank 0's collective times out first, which the ledger names, with rank 1 as the hang's culprit.
        Case("collective-timeout", mode, "train", "program", "collective-timeout", words="Timed out",
             env={"FAULT": "block", "FAULT_STEP": "25"}, values=TIMEOUT_FIRST),
        Case("exception-once", mode, "train", "program", "program-error",
             words="RuntimeError: fault drill: the batch at step 25 has a bad shape",
             env={"FAULT": "raise", "FAULT_STEP": "25", "FAULT_ATTEMPTS": "1"}),
        Case("config-error", mode, "train", "none", "config-error", job="config-error", words="data.path",
             values={"train": {"config": {"data": {"path": "/nonexistent/tokens.bin"}}}}),
        Case("nan-loss-twice", mode, "train", "none", "loss-nan", job="loss-nan", words="stopped before saving",
             values=NAN, ci=mode == "nossh"),
        Case("full-volume", mode, "train", "full", "storage-error", job="storage-error", words="full:",
             values={"train": {"config": {"steps": 200, "keep_checkpoints": 100}}}),
        Case("budget-spent", mode, "train", "kill", "program-error", job="budget-spent",
             values={"job": {"runRetries": 0}}),
        Case("no-progress", mode, "train", "program", "program-error", job="no-progress",
             env={"FAULT": "raise", "FAULT_STEP": "25", "FAULT_ATTEMPTS": "1", "FAULT_FROM_ATTEMPT": "2"},
             values={"job": {"runRetries": 5}}),
        Case("same-error-twice", mode, "train", "program", "program-error", job="program-error",
             words="bad shape", env={"FAULT": "raise", "FAULT_STEP": "25", "FAULT_ATTEMPTS": "all"},
             values={"job": {"runRetries": 5}}, ci=mode == "nossh"),
        Case("preempted", mode, "train", "sigterm", "preempted", job="preempted"),
        # The chart's default storage (an emptyDir per pod, no claim, no bucket): worker 1's pod is lost and a new
        # pod with an empty volume takes its place; the job resumes from the copy worker 0 keeps of its part.
        Case("pod-deleted", mode, "train", "replace-sigterm", "preempted", values=DEFAULT_STORAGE),
        Case("pod-killed", mode, "train", "replace-kill", "node-lost", words="left during the attempt without a "
             "SIGTERM", values=DEFAULT_STORAGE),
        # Killed while its part is on the way to worker 0 (a model whose part takes a while to copy): the cut copy
        # is never held, and the job resumes from one that is whole.
        Case("killed-mid-copy", mode, "train", "kill-mid-copy", "node-lost", values=merge(DEFAULT_STORAGE, {
            "train": {"config": {"model": {"n_layer": 4, "d_model": 512}}}})),
        # Three workers, two neighbouring pods (1 and 2) lost at once: worker 2's part was on worker 1's volume.
        # The job stops in one line (a config error: never retried), never training from step 0.
        Case("two-neighbours-lost", mode, "train", "replace-two-kill", "node-lost", job="config-error",
             values=merge(DEFAULT_STORAGE, {"worker": {"replicas": 3}})),
    ]


def trainer_cases(mode: str) -> list[Case]:
    return [
        Case("completes", mode, "trainer", "none", "completed"),
        Case("kill-9", mode, "trainer", "kill", "program-error", words="was killed by SIGKILL"),
        Case("sigstop", mode, "trainer", "stop", "hang", words="its process is stopped", values=HANG),
        # HfArgumentParser raises on an unknown option (ValueError, exit 1): a program error that the rank's
        # own output witnesses (files/rank-log.py), retried once (no step: "the same step" cannot be said).
        Case("unknown-option", mode, "trainer", "none", "program-error", job="budget-spent",
             words="ValueError: Some specified arguments are not used by the HfArgumentParser",
             values={"train": {"args": ["--no_such_option=1"]}}),
        Case("bad-value", mode, "trainer", "none", "config-error", job="config-error",  # argparse: exit 2
             values={"train": {"args": ["--max_steps=many"]}}),
        Case("pod-deleted", mode, "trainer", "replace-sigterm", "preempted", values=LONG_TRAINER),
        Case("pod-killed", mode, "trainer", "replace-kill", "node-lost", values=LONG_TRAINER),
    ] + ([Case("preempted", mode, "trainer", "sigterm", "preempted", job="preempted")] if mode == "ssh" else [])


def merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, dicts merged; a None removes the key."""
    out = dict(base)
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
            continue
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


CASES = [*train_cases("ssh"), *train_cases("nossh"), *trainer_cases("ssh"), *trainer_cases("nossh")]


def values_for(case: Case, shared_dir: Path) -> dict:
    if case.program == "trainer":
        values = trainer_values(shared_dir, max_steps=40)
        values["train"]["args"] = [*values["train"]["args"], *case.values.get("train", {}).get("args", [])]
        values["job"]["runRetries"] = 1
    else:
        values = e2e_values(shared_dir, steps=60, log_every=5, checkpoint_every=10)
        values["train"]["module"] = "tests.e2e.fault_probe"
        values["env"] += [{"name": k, "value": v} for k, v in case.env.items()]
        values["job"]["runRetries"] = 1
    values["launchMode"] = case.mode
    return merge(values, {k: v for k, v in case.values.items() if not (case.program == "trainer" and k == "train")})


def ledger(cluster: Cluster, owner) -> tuple[list[dict], dict]:
    """Every attempt's cause.json, and the verdict, where the ledger's owner keeps them (on the shared claim, or in
    its pod). A ledger its volume could not take (full) left only the verdict: attempt 1's cause is the verdict's."""
    state = cluster.rank_state_dir(owner)
    roots = [state / "attempts"]
    if any(m["name"] == "checkpoints" for m in owner.container.get("volumeMounts", [])):
        roots.append(cluster.checkpoint_dir(owner) / "_job" / "attempts")
    causes = [json.loads(p.read_text()) for root in roots for p in sorted(root.glob("*/[0-9]*/cause.json"))]
    verdict = json.loads((state / "verdict.json").read_text()) if (state / "verdict.json").exists() else {}
    if not causes and verdict.get("cause"):
        causes = [{"cause": verdict["cause"], "reason": verdict.get("reason", "")}]
    return causes, verdict


def inject(case: Case, cluster: Cluster, victim_pod, owner_process, log):
    """The case's fault, once rank 1 (on the second worker) is training; the replacement pod's process where the
    fault replaces worker 1's pod (its controller's new pod: the same host, an empty volume)."""
    if case.fault in ("none", "program", "full"):
        return None
    wait_for(lambda: any(s.startswith("training") and "step=" in s for s in cluster.rank_states(victim_pod)), 240,
             "rank 1 to train", log)
    if case.fault.startswith("replace-") or case.fault == "kill-mid-copy":
        keeper = cluster.checkpoint_dir(cluster.pods_of("worker")[0]) / "_job" / "peer" / "1"
        wait_for(lambda: (keeper / "copy.json").is_file(), 240, "a part of worker 1's kept on worker 0", log)
        if case.fault == "kill-mid-copy":  # a newer copy of worker 1's part arriving on worker 0: kill its sender
            wait_for(lambda: any(keeper.glob(".incoming-*")), 240, "worker 1's next part on its way to worker 0",
                     log, interval=0.01)
        if case.fault == "replace-sigterm":
            cluster.signal_main(victim_pod.process, signal.SIGTERM)
            wait(victim_pod.process, timeout=120)
        elif case.fault == "replace-two-kill":  # worker 2 too, once worker 1 keeps a part of its
            wait_for(lambda: (cluster.checkpoint_dir(victim_pod) / "_job" / "peer" / "2" / "copy.json").is_file(),
                     240, "a part of worker 2's kept on worker 1", log)
            neighbour = cluster.pods_of("worker")[2]
            cluster.kill(victim_pod)
            cluster.kill(neighbour)
            cluster.start(neighbour, log_name=f"{neighbour.name}-new", new_pod=True)
        else:
            cluster.kill(victim_pod)
        return cluster.start(victim_pod, log_name=f"{victim_pod.name}-new", new_pod=True)
    time.sleep(0.5 if case.program == "train" else 0)
    if case.fault == "sigterm":  # the job preempted: ssh, its launcher's pod; nossh, every worker's (one worker's
        # pod alone is the pod-deleted case: the Job controller replaces it and the job goes on)
        targets = [owner_process] if case.mode == "ssh" else [pod.process for pod in cluster.pods_of("worker")]
        for target in targets:
            cluster.signal_main(target, signal.SIGTERM)
        return None
    pids = cluster.rank_pids(victim_pod, ranks_only=True)
    assert pids, "no rank on the second worker"
    os.kill(pids[0], signal.SIGKILL if case.fault == "kill" else signal.SIGSTOP)
    return None


@contextmanager
def claims(full: bool):
    """The e2e claims; for a full volume, `checkpoints` a 6 MiB tmpfs (room for about three tags of the drill's model,
    with keep_checkpoints raised so that they pile up). None: the harness's own."""
    if not full:
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="ds-drill-claims-"))
    root.chmod(0o755)
    volume = root / "claims" / "checkpoints"
    volume.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m,mode=0777", "tmpfs", str(volume)], check=True)
    try:
        yield Claims(root)
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def run_case(case: Case, shared_dir: Path, tmp_path: Path) -> tuple[str, str, dict]:
    values = values_for(case, shared_dir)
    with claims(case.fault == "full") as shared, Cluster(render(values), claims=shared) as cluster:
        workers = cluster.pods_of("worker")
        if case.mode == "ssh":
            cluster.start_workers()
            owner = cluster.pods_of("launcher")[0]
            processes = [cluster.start(owner)]
        else:
            owner = workers[0]
            processes = [cluster.start(w) for w in workers]
        log = owner.log
        replacement = inject(case, cluster, workers[1], processes[0], log)
        if replacement is not None and case.mode == "nossh":
            processes[1] = replacement
        codes = [wait(p, timeout=600) for p in processes]
        causes, verdict = ledger(cluster, owner)
        if case.fault == "stop":  # the stopped rank's process is left to the pod's end
            for pid in cluster.rank_pids(workers[1], ranks_only=True):
                os.kill(pid, signal.SIGCONT)
    first = causes[0] if causes else {}
    job = verdict.get("cause", "") if verdict.get("state") != "done" else "completed"
    if case.job == "preempted" and verdict.get("state") in ("stopped", "stopping"):
        job = "preempted"
    return first.get("cause", ""), job, {"codes": codes, "first": first, "verdict": verdict, "log": log()[-6000:]}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[] if c.ci or ALL else pytest.mark.skip(
    reason="`make drill-faults` runs it (DS_DRILLS=faults)")) for c in CASES])
def test_each_fault_ends_its_attempt_with_the_expected_cause(case, shared_dir, tmp_path, drill_table):
    if case.program == "trainer":
        pytest.importorskip("transformers", reason="the Hugging Face stack (pyproject's hf extra)")
    cause, job, seen = run_case(case, shared_dir, tmp_path)
    ok = cause == case.cause and job == case.job and case.words in seen["first"].get("reason", "")
    RESULTS.append((case.id, f"{case.cause} / {case.job}", f"{cause} / {job}", ok))
    assert ok, (case, cause, job, seen["first"], seen["verdict"], seen["codes"], seen["log"])


@pytest.fixture(scope="module")
def drill_table():
    yield
    if RESULTS:
        width = max(len(r[0]) for r in RESULTS)
        lines = [f"{'case':<{width}}  {'expected (attempt 1 / job)':<36}  {'reported':<36}  ok"]
        lines += [f"{name:<{width}}  {expected:<36}  {reported:<36}  {'yes' if ok else 'NO'}"
                  for name, expected, reported, ok in RESULTS]
        right = sum(ok for *_, ok in RESULTS)
        lines.append(f"{right} of {len(RESULTS)} as expected ({100 * right / len(RESULTS):.0f}%)")
        print("\n\nfault drill\n" + "\n".join(lines))
