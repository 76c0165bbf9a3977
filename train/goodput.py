"""Where a job's wall time went, across all its attempts: productive steps, start-up, checkpoint restore and save,
recomputation (steps a failure lost, trained again from the last complete checkpoint), time hung, and what none of
them measured (`unaccounted`, reported, never folded in).

Rank 0 keeps one record per attempt in <checkpoint_dir>/_job/goodput/<job>/<begun ms>-<attempt>.json (replaced
atomically, at most every FLUSH_S, at every save and at the end), and beside it the same name .step, one fixed-width
line that every step rewrites in place (one pwrite, as the heartbeat: `last_step productive_s updated`); wall-clock
times:
- `begun`: when the attempt began (DS_ATTEMPT_BEGUN from the chart's ledger, files/attempts.py; else this
  process's start)
- `first_step`: when its first step started; `restore_s`: its checkpoint load; `save_s`: its saves
- `productive_s`: its steps' time, each from the end of the step or save before it (the program's loop between
  steps is the steps' time, as on a stopwatch: train/report.py, train/hf_callback.py), with the value at each saved
  step (`at_step`), so that the steps a later attempt trains again count as recomputation instead
- `resumed_from`, `last_step`, `updated` (the end of its last step or save), `run` (DS_RUN_ID)
- `started`: rank 0's process start; `rendezvous_s`: its process group's set-up, where the program says
  (the train package); `first_step_s`: the first step's time
- `previous_run`, `previous_hung_at`, `previous_failed_at`, `previous_ended`: the attempt before, when a watchdog
  first reported it hung, when its first rank said why it ended and when it ended (DS_PREVIOUS_RUN_* from the
  ledger: its owner merged every host's evidence, so the times are known on per-pod volumes too, where a report
  lies on another pod's)
An attempt spans from the end of the one before (its `updated`; after a hang, the report's time, and the time since
`updated` is time hung) to its own end. Start-up is the part of that span before its first step, less the restore:
for a retry it includes noticing the failure and starting the ranks again. The job's wall time runs from its first
attempt's `begun` to the last end.

A fault's loss by its parts (fault_parts, protocol.FAULT_PARTS), from the failed attempt's last progress to the end
of the next attempt's first step, each part between two of these moments: detect (until a watchdog reported the
hang, or a rank said why it ended), stop (until the ledger's owner saw every rank end), reschedule (until the next
attempt began: the loop's turn, or new pods scheduled and started), start (the launchers, the program's imports
and its engine), rendezvous (the process group, where the program says), load (the checkpoint's restore),
first_step; then recompute, the steps trained again since the checkpoint. A part whose moments are not known (a run
outside the chart, a rank that said nothing) is left out of the split and its time goes to the next one.
"""

import json
import os
import time
from pathlib import Path

from podruntime import protocol
from podruntime.ledger import job_tree
from podruntime.tenantfiles import Tree

FLUSH_S = 2.0
KEEP_SAVES = 50  # the productive time at the last saves: a retry resumes from one of them
BUCKETS = protocol.GOODPUT_BUCKETS  # published under these names (the sidecar's metrics take no others)
TAIL_BYTES = 64


def _process_start() -> float:
    """This process's start, wall clock (Linux: /proc/self/stat field 22, in clock ticks after boot)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


class Goodput:
    """Rank 0's record of this attempt (no file when `ckpt_dir` is None)."""

    def __init__(self, ckpt_dir: Path | None, resumed_from: int, restore_s: float, rendezvous_s: float | None = None):
        run = os.environ.get("DS_RUN_ID", "")
        parsed = protocol.parse_run_id(run)
        self.directory = None
        if ckpt_dir:
            records = job_tree(Tree(ckpt_dir, trusted_root=True), protocol.GOODPUT)
            self.directory = records.root / (parsed[1] if parsed else "local")
            records.prune("", protocol.KEEP_JOBS, spare=self.directory.name)
        attempt = os.environ.get("DS_ATTEMPT", "")
        try:
            begun = float(os.environ.get("DS_ATTEMPT_BEGUN", ""))
        except ValueError:
            begun = _process_start()
        # Named by its start, then its number: in time order, also where each launcher pod numbers its own attempts
        # (ssh without a shared claim), so that a new pod's attempt 1 is not the old pod's.
        name = f"{int(begun * 1000):014d}-{int(attempt) if attempt.isdigit() else 1:04d}.json"
        self.path = self.directory / name if self.directory else None
        self.record = {"begun": begun, "first_step": None, "restore_s": restore_s, "save_s": 0.0,
                       "productive_s": 0.0, "at_step": {}, "resumed_from": resumed_from, "last_step": resumed_from,
                       "updated": time.time(), "run": run, "started": _process_start(),
                       "rendezvous_s": rendezvous_s, "first_step_s": None,
                       "previous_run": os.environ.get(protocol.ATTEMPT_ENV["previous_run"], ""),
                       **{key: protocol.number(os.environ.get(protocol.ATTEMPT_ENV[key]))
                          for key in ("previous_hung_at", "previous_failed_at", "previous_ended")}}
        self.flushed = 0.0
        self.tail: int | None = None  # <attempt>.step, open for the per-step pwrite
        self._past: dict[str, dict] | None = None  # the earlier attempts' records (_past_records)
        if self.directory and not run and self.directory.is_dir():  # a run outside the chart is a job of its own
            for old in self.directory.iterdir():
                old.unlink(missing_ok=True)

    def step(self, step: int, started: float, seconds: float) -> None:
        """A step that started at wall time `started` took `seconds`."""
        record = self.record
        if record["first_step"] is None:
            record["first_step"], record["first_step_s"] = started, seconds
        record["productive_s"] += seconds
        record["last_step"], record["updated"] = step, started + seconds
        if time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()
        if self.tail is not None:
            line = f"{step} {record['productive_s']:.6f} {record['updated']:.6f}".ljust(TAIL_BYTES - 1) + "\n"
            try:
                os.pwrite(self.tail, line.encode(), 0)
            except OSError:
                pass

    def saved(self, step: int, seconds: float) -> None:
        record = self.record
        record["save_s"] += seconds
        record["at_step"][str(step)] = record["productive_s"]
        if len(record["at_step"]) > KEEP_SAVES:
            del record["at_step"][next(iter(record["at_step"]))]
        record["updated"] = time.time()
        self.flush()

    def flush(self) -> None:
        self.flushed = time.monotonic()
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(json.dumps(self.record))
            os.replace(tmp, self.path)
            if self.tail is None:
                self.tail = os.open(self.path.with_suffix(".step"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            pass  # accounting must never stop training

    def job(self) -> dict:
        """The whole job so far: every attempt's record (this one as it is now), split into BUCKETS."""
        records = {**self._past_records(), self.path.name if self.path else "current": self.record}
        attempts = [records[name] for name in sorted(records)]
        split = dict.fromkeys(BUCKETS, 0.0)
        start = attempts[0]["begun"]
        end = start
        for i, record in enumerate(attempts):
            killed = _hung_at(record, attempts[i + 1]) if i + 1 < len(attempts) else None
            hung = max(0.0, killed - record["updated"]) if killed else 0.0
            lost = _lost(record, attempts[i + 1]) if i + 1 < len(attempts) else 0.0
            split["productive"] += record["productive_s"] - lost
            split["recomputation"] += lost
            split["save"] += record["save_s"]
            split["restore"] += record["restore_s"]
            split["hung"] += hung
            if record["first_step"] is not None:  # from the end of the attempt before (or the job's start)
                split["startup"] += max(0.0, record["first_step"] - end - record["restore_s"])
            end = max(end, record["updated"]) + hung
        wall = end - start
        return {**{k: round(v, 3) for k, v in split.items()}, "wall": round(wall, 3),
                "unaccounted": round(wall - sum(split.values()), 3), "attempts": len(attempts)}

    def last_fault(self) -> dict | None:
        """The newest fault's loss by its parts (fault_parts), once this attempt's first step has ended; None for
        a first attempt. The records are read afresh, not kept: at the first step an attempt before may still be
        writing its last (ranks a lost pod left behind, stopping)."""
        past = self._read_past()
        if not past or self.record["first_step"] is None:
            return None
        return fault_parts(past[max(past)], self.record)

    def _past_records(self) -> dict[str, dict]:
        """The earlier attempts' records, read once: they are over by the time this one logs a step."""
        if self._past is None:
            self._past = self._read_past()
        return self._past

    def _read_past(self) -> dict[str, dict]:
        past = {}
        paths = sorted(self.directory.glob("[0-9]*.json")) if self.directory and self.directory.is_dir() else []
        for path in (p for p in paths if not self.path or p.name != self.path.name):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not _valid(record):
                continue
            try:
                step, productive, updated = path.with_suffix(".step").read_text().split()
                if int(step) > record["last_step"]:  # the last steps, newer than the last flush
                    record.update(last_step=int(step), productive_s=float(productive),
                                  updated=max(record["updated"], float(updated)))
            except (OSError, ValueError):
                pass
            past[path.name] = record
        return past


def _hung_at(record: dict, after: dict) -> float | None:
    """When `record`'s attempt was reported hung, from the attempt after it (None: not reported, or the record after
    it is not its next attempt's: that one's rank 0 never got so far)."""
    if not record["run"] or after.get("previous_run") != record["run"]:
        return None
    return protocol.number(after.get("previous_hung_at"))


def _lost(record: dict, after: dict) -> float:
    """The productive seconds of `record`'s attempt that the attempt after it trains again (it resumed from an
    earlier step)."""
    later = after["resumed_from"]
    if later >= record["last_step"]:
        return 0.0
    return max(0.0, record["productive_s"] - record["at_step"].get(str(later), 0.0))


def fault_parts(before: dict, after: dict) -> dict | None:
    """The loss of the fault that ended `before`'s attempt, by protocol.FAULT_PARTS (seconds; a part whose moments
    are not known is left out, its time in the next part) and `total`, with `attempt`, the attempt that resumed;
    None until `after`'s first step has ended."""
    first, first_s = after.get("first_step"), protocol.number(after.get("first_step_s"))
    if first is None or first_s is None:
        return None
    ours = bool(before["run"]) and after.get("previous_run") == before["run"]
    last, begun = before["updated"], after["begun"]

    def moment(key: str) -> float | None:  # the ledger's, only within the gap it describes
        value = protocol.number(after.get(key)) if ours else None
        return value if value is not None and last <= value <= begun else None

    rendezvous = protocol.number(after.get("rendezvous_s"))
    rendezvous = rendezvous if rendezvous is not None and 0 <= rendezvous <= first - begun else None
    load = min(max(0.0, after["restore_s"]), max(0.0, first - begun - (rendezvous or 0.0)))
    moments = [("detect", moment("previous_hung_at") or moment("previous_failed_at")),
               ("stop", moment("previous_ended")), ("reschedule", begun), ("start", None)]
    parts, since = {}, last
    for name, until in moments:
        if until is not None:
            parts[name], since = max(0.0, until - since), max(since, until)
    parts["start"] = max(0.0, first - since - (rendezvous or 0.0) - load)
    if rendezvous is not None:
        parts["rendezvous"] = rendezvous
    parts.update(load=load, first_step=max(0.0, first_s), recompute=_lost(before, after))
    parts = {name: round(parts[name], 3) for name in protocol.FAULT_PARTS if name in parts}
    attempt = protocol.parse_run_id(after["run"])
    return {**parts, "total": round(sum(parts.values()), 3), **({"attempt": attempt[0]} if attempt else {})}


def describe_fault(parts: dict) -> str:
    """`attempt 3 resumed 14.2s after the fault: detect 2.1s + stop 0.3s + ... + recompute 4.6s`."""
    named = " + ".join(f"{name.replace('_', ' ')} {parts[name]:.1f}s" for name in protocol.FAULT_PARTS
                       if name in parts)
    who = f"attempt {parts['attempt']}" if "attempt" in parts else "the retry"
    return f"{who} lost {parts['total']:.1f}s to the fault before it: {named}"


def _valid(record) -> bool:
    """A record as Goodput writes it (a hand-edited or truncated one is left out, never a crash at the end)."""
    numbers = ("begun", "restore_s", "save_s", "productive_s", "updated")
    return (isinstance(record, dict) and all(isinstance(record.get(k), int | float) for k in numbers)
            and isinstance(record.get("first_step"), int | float | None) and isinstance(record.get("at_step"), dict)
            and isinstance(record.get("resumed_from"), int) and isinstance(record.get("last_step"), int)
            and isinstance(record.get("run"), str))


def describe(split: dict) -> str:
    """`goodput 91.2% | wall 120.3s = productive 109.7s + start-up 6.1s + ... + unaccounted 0.8s (3 attempts)`."""
    wall = split["wall"] or 1e-9
    names = {"startup": "start-up"}
    parts = " + ".join(f"{names.get(k, k)} {split[k]:.1f}s" for k in (*BUCKETS, "unaccounted"))
    return (f"goodput {100 * split['productive'] / wall:.1f}% | wall {split['wall']:.1f}s = {parts} "
            f"({split['attempts']} attempt{'s' if split['attempts'] != 1 else ''})")


def published(split: dict | None, fault: dict | None = None) -> dict:
    """The progress fields rank 0 publishes of a split and of the newest fault's parts (train/rankstate.py): the
    numbers and their lines; an empty or missing one leaves its fields as they were."""
    return {"goodput": split or None, "goodput_line": describe(split) if split else None,
            "fault": fault or None, "fault_line": describe_fault(fault) if fault else None}
