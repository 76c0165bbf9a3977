"""Checkpoints that a restarted job can trust.

DeepSpeed writes its `latest` marker with a plain write and, when it is missing, load_checkpoint quietly
starts from scratch. Here a checkpoint counts only once it is COMMITTED: every rank has written and
fsynced its shards, then the directory's writer writes `commit.json` (the tag's file list and sizes) and replaces
`latest`, each atomically (temporary file, fsync, rename). Resume picks the newest tag that every rank sees
committed with all its files there; a dir that holds checkpoints of which none is complete is an error, never a
fresh start.

Storage (DS_CHECKPOINT_STORAGE, the chart's): `shared`, one directory every rank sees (a shared claim, or one
machine), whose writer is global rank 0; or `per-worker`, a volume per worker pod: each worker's ranks write their
own shards (and, with DeepSpeed's `checkpoint.use_node_local_storage`, which the chart sets, the model states) to
their pod's volume, each worker's local rank 0 commits the part its volume holds, and a tag is complete only where
every worker committed its part: a crash between two workers' commits leaves a tag that no rank resumes from.

Background saves (--checkpoint-background, on by default): the step loop waits only while DeepSpeed's state is
copied into host memory (SnapshotEngine, DeepSpeed's checkpoint-engine interface); a thread per rank writes and
fsyncs the copy while training goes on, and the tag is committed, as above, once every rank reports its writes
durable (Checkpointer.poll, one small all-reduce a step while a save is in flight). A save at the last step or at
SIGTERM, and any save while an earlier one is still being written, waits for it: at most one tag is in flight.
The copy costs host memory the size of this rank's part of the checkpoint.
"""

import argparse
import copy
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import deepspeed.comm as dist
import torch
from deepspeed.checkpoint.constants import (
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)

from podruntime import checkpoints as tags
from podruntime.checkpoints import COMMIT_FILE, TAG_PATTERN
from podruntime.ownership import ADOPT_ENV, OWNER_ENV
from podruntime.tenantfiles import Tree
from podruntime.text import error_line
from train import rankstate

UNIVERSAL_DIR = "universal"  # <ckpt>/universal/<tag>: a tag converted for another layout, committed like a tag
# What DeepSpeed's converter (ds_to_universal) needs in the client state of a plain data-parallel model.
UNIVERSAL_INFO = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


STORAGE_ENV, SHARED, PER_WORKER = tags.STORAGE_ENV, tags.SHARED, tags.PER_WORKER


def _tree(directory: Path) -> Tree:
    """This program's own checkpoint directory (its path may run through links; nothing beneath it is followed)."""
    return Tree(directory, trusted_root=True)


def files_of(tag_dir: Path) -> dict[str, int]:
    """Every regular file of a tag with its size (podruntime.checkpoints owns the rule)."""
    return tags.files_of(_tree(tag_dir.parent), tag_dir.name)


def is_complete(tag_dir: Path) -> bool:
    """A train package tag whose commit.json lists files that are all there with their sizes."""
    return tags.is_complete(_tree(tag_dir.parent), tag_dir.name)


def tags_newest_first(ckpt_dir: Path) -> list[Path]:
    """The train package's tag directories, complete or not, newest first."""
    return [ckpt_dir / tag for tag in tags.tags_newest_first(_tree(ckpt_dir))]


class CheckpointError(RuntimeError):
    """The checkpoint dir cannot be used as asked; names the dir and what is wrong."""


class StorageError(CheckpointError):
    """Writing a checkpoint failed on this rank's volume (full, read-only, gone): the attempt's cause is
    storage-error. `echo`: it failed on another rank, whose line says why."""

    def __init__(self, message: str, echo: bool = False):
        super().__init__(message)
        self.echo = echo


def storage_for(workers: int, shared_claim: bool) -> str:
    """The storage of a chart release: per-worker when several workers have no shared claim (their per-pod
    volumes: an emptyDir, a StatefulSet's claim per worker, an ephemeral volume). The chart's
    deepspeed-training.checkpointStorage follows this rule (tests/test_chart.py holds them together)."""
    return PER_WORKER if workers > 1 and not shared_claim else SHARED


def storage() -> str:
    value = os.environ.get(STORAGE_ENV) or SHARED
    if value not in (SHARED, PER_WORKER):
        raise CheckpointError(f"{STORAGE_ENV}={value!r}: expected {SHARED!r} or {PER_WORKER!r}")
    return value


def check_storage(ds_config: dict, layout, storage_: str, source: str) -> None:
    """What per-worker volumes cannot hold: a checkpoint whose files a rank needs were written by a rank of another
    worker. Pipeline stages: DeepSpeed writes each stage's layers from its first data-parallel rank only. ZeRO's
    `elastic_checkpoint`: every rank reads every rank's optimizer shards."""
    if storage_ != PER_WORKER:
        return
    where = "with per-worker checkpoint volumes (several workers, no checkpoints.existingClaim)"
    if layout.pipeline_stages > 1:
        raise CheckpointError(f"model.pipeline_stages {layout.pipeline_stages} {where}: DeepSpeed writes each stage's "
                              "layers from one data-parallel rank only, so the other workers could not resume; give "
                              "the release a shared claim")
    zero = ds_config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("elastic_checkpoint"):
        raise CheckpointError(f"ds_config {source}: zero_optimization.elastic_checkpoint {where}: every rank would "
                              "read every rank's optimizer shards on resume; remove it or give the release a shared "
                              "claim")


def writes_commits() -> bool:
    """Whether this rank commits what its checkpoint directory holds: global rank 0 of a shared directory, each
    worker's local rank 0 of per-worker volumes."""
    if storage() == PER_WORKER:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0
    return dist.get_rank() == 0


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(ckpt_dir: Path) -> None:
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # A unique name: ranks on other pods share the dir and often the same pid.
        with tempfile.NamedTemporaryFile(dir=ckpt_dir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise CheckpointError(f"checkpoint dir {ckpt_dir}: not writable ({err.strerror}); "
                              "mount a writable volume or pass another --checkpoint-dir") from None


def release() -> str:
    """`<namespace>/<release>` that owns this run's checkpoints (the chart's DS_RELEASE); "" outside the chart."""
    return os.environ.get("DS_RELEASE", "")


def resume_source() -> tuple[Path, str] | None:
    """(dir, release) of another release's checkpoints this run may start from when its own dir holds none: the
    platform's opt-in (chart value checkpoints.resumeFrom, mounted read-only); None without it."""
    directory, owner = os.environ.get("DS_RESUME_FROM_DIR", ""), os.environ.get("DS_RESUME_FROM_RELEASE", "")
    return (Path(directory), owner) if directory and owner else None


def identity() -> str:
    """The platform-issued project identity that owns this run's storage (podruntime.ownership); "" without one."""
    return os.environ.get(OWNER_ENV, "")


def check_owner(manifest: dict, tag_dir: Path, expected: str, own: bool = True) -> None:
    """A checkpoint names the release and the project identity that wrote it; resuming another's is refused
    (checkpoints of releases sharing a claim never mix). In the release's own directory the identity decides where
    both sides have one (a name can be taken again by another project; the platform's adoption, ADOPT_ENV, is
    accepted as ours); else the release name does. Checkpoints written outside the chart name neither."""
    writer, ours = manifest.get("owner", ""), identity()
    if own and writer and ours:
        if writer not in (ours, os.environ.get(ADOPT_ENV, "")):
            raise CheckpointError(f"checkpoint {tag_dir} belongs to project {writer}, not to {ours}: a release "
                                  "resumes only its own project's checkpoints (the platform adopts another's with "
                                  "checkpoints.adoptOwner)")
        return
    owner = manifest.get("release", "")
    if expected and owner and owner != expected:
        raise CheckpointError(f"checkpoint {tag_dir} belongs to release {owner}, not to {expected}: a release resumes "
                              "only its own checkpoints (to start from another release's, the platform sets "
                              "checkpoints.resumeFrom)")


LAYOUT_DEFAULTS = {"pipeline_stages": 1}  # what checkpoints from before a layout key existed were written with


def read_manifest(tag_dir: Path) -> dict:
    return json.loads((tag_dir / COMMIT_FILE).read_text())


def local_view(ckpt_dir: Path) -> tuple[list[str], list[str]]:
    """(the tags this rank sees complete, every tag it sees), newest first."""
    tags = tags_newest_first(ckpt_dir)
    return [t.name for t in tags if is_complete(t)], [t.name for t in tags]


def agree_on_resume_tag(ckpt_dir: Path, rank: int, world_size: int, logger) -> str | None:
    """The tag every rank resumes from: the newest that every rank sees complete (on a shared directory, what rank 0
    sees; on per-worker volumes, the newest every worker committed its part of). Every rank reaches the same
    verdict, errors included, so none waits for a peer that gave up."""
    views = [None] * world_size
    dist.all_gather_object(views, local_view(ckpt_dir))
    step = lambda tag: int(TAG_PATTERN.match(tag).group(1))  # noqa: E731
    everywhere = set.intersection(*(set(complete) for complete, _ in views))
    seen = {tag for _, tags in views for tag in tags}
    tag = max(everywhere, key=step, default=None)
    for name in sorted((t for t in seen if tag is None or step(t) > step(tag)), key=step, reverse=True):
        logger.warning(f"skipping incomplete checkpoint {ckpt_dir / name}")
    if tag is not None or not seen:
        return tag
    somewhere = {t for complete, _ in views for t in complete}
    if not somewhere:
        raise CheckpointError(
            f"checkpoint dir {ckpt_dir}: none of its {len(seen)} checkpoints is complete "
            f"({', '.join(sorted(seen, key=step, reverse=True))}); refusing to start from scratch over them. Move "
            "them away to start fresh.")
    newest = max(somewhere, key=step)
    have = [r for r, (complete, _) in enumerate(views) if newest in complete]
    missing = [r for r in range(world_size) if r not in have]
    if storage() == PER_WORKER:
        why = ("each worker keeps its ranks' part on its own volume (per-worker checkpoint storage), and the volume "
               "of the worker(s) of those ranks no longer holds it (a new pod, a new node): nothing on these "
               "volumes can resume the job. Give the release a shared claim (checkpoints.existingClaim) for "
               "checkpoints that outlive a pod, or move the checkpoints away to start fresh")
    else:
        why = ("the checkpoint dir must be one volume shared by all workers (checkpoints.existingClaim, a "
               "ReadWriteMany PVC)")
    raise CheckpointError(f"checkpoint {ckpt_dir / newest} is complete on rank(s) {have} but not on rank(s) "
                          f"{missing}: {why}")


def check_save_fits_grace(manifest: dict, tag_dir: Path, logger) -> None:
    """Warns when the checkpoint took longer to save than the ranks get after SIGTERM (the chart's
    DS_KILL_GRACE_SECONDS): a preemption's save would then be cut off, and its steps lost."""
    grace, took = os.environ.get("DS_KILL_GRACE_SECONDS", ""), manifest.get("save_s")
    if grace.isdigit() and isinstance(took, (int, float)) and took > int(grace):
        logger.warning(f"checkpoint {tag_dir} took {took:.0f}s to save, but a SIGTERM (eviction, preemption, "
                       f"upgrade) leaves the ranks {grace}s: that save would be cut off and the steps since the "
                       "last periodic checkpoint lost; raise worker.terminationGracePeriodSeconds")


def saved_layout(manifest: dict, layout: dict) -> dict:
    return {key: manifest.get(key, LAYOUT_DEFAULTS.get(key, value)) for key, value in layout.items()}


def describe_layout(layout: dict) -> str:
    text = f"{layout['world_size']} ranks, ZeRO stage {layout['zero_stage']}"
    return text + (f", {layout['pipeline_stages']} pipeline stages" if layout["pipeline_stages"] > 1 else "")


def cross_layout_load(tag_dir: Path, saved: dict, layout: dict, allowed: bool, weights_only: bool) -> str:
    """How a checkpoint of another layout can be loaded: "weights" (model weights only, any data-parallel size)
    or "universal" (DeepSpeed's universal checkpoint: weights, optimizer and scheduler state at any
    data-parallel size). Raises CheckpointError, saying why, for what cannot be loaded."""
    what = f"checkpoint {tag_dir} was written with {describe_layout(saved)}; this run has {describe_layout(layout)}"
    if storage() == PER_WORKER:
        raise CheckpointError(f"{what}: a resume on another layout reads every rank's shards from one directory, "
                              "and per-worker volumes (no checkpoints.existingClaim) each hold their workers' only; "
                              "resume with the saved layout, or give the release a shared claim")
    if not allowed:
        raise CheckpointError(f"{what}, and resuming on another layout is switched off (chart value "
                              "checkpoints.resumeAcrossWorldSizes): resume with the same layout or start in an "
                              "empty checkpoint dir")
    if saved["pipeline_stages"] != layout["pipeline_stages"]:
        raise CheckpointError(f"{what}: a pipeline checkpoint resumes only with the same model.pipeline_stages")
    if (saved["zero_stage"] == 3) != (layout["zero_stage"] == 3):
        raise CheckpointError(f"{what}: DeepSpeed converts checkpoints between ZeRO stages 1 and 2, or from stage "
                              "3 to stage 3, not across: resume with the saved stage")
    if weights_only:
        return "weights"
    if layout["pipeline_stages"] > 1 or 0 in (saved["zero_stage"], layout["zero_stage"]):
        raise CheckpointError(f"{what}: DeepSpeed's universal checkpoint needs ZeRO stage 1, 2 or 3 without "
                              "pipeline stages; set reset_optimizer: true to resume the weights only (fresh "
                              "optimizer state), or resume with the saved layout")
    return "universal"


def universal_copy(ckpt_dir: Path, tag: str, rank: int, logger, into: Path | None = None) -> Path:
    """<into>/universal/<tag> (`into` defaults to `ckpt_dir`; another release's dir is read-only), DeepSpeed's
    universal form of `tag`, converted once: rank 0 converts into a temporary dir, renames it into place and
    commits it like a checkpoint (the original is only read); the other ranks wait, and every rank gets the
    outcome. A complete copy is reused."""
    target = (into or ckpt_dir) / UNIVERSAL_DIR / tag
    outcome = [None]
    if rank == 0:
        try:
            if is_complete(target):
                outcome[0] = ("ok", f"reusing the universal copy {target}")
            else:
                started = time.perf_counter()
                _convert(ckpt_dir / tag, target)
                outcome[0] = ("ok", f"converted {ckpt_dir / tag} to the universal checkpoint {target} in "
                                    f"{time.perf_counter() - started:.1f}s")
        except Exception as err:  # noqa: BLE001 - every failure must reach the other ranks, not only this one
            outcome[0] = ("error", f"checkpoint {ckpt_dir / tag}: DeepSpeed's universal conversion failed: {err}")
    dist.broadcast_object_list(outcome, src=0)
    verdict, message = outcome[0]
    if verdict == "error":
        raise CheckpointError(message)
    logger.info(message)
    return target


def _convert(source: Path, target: Path) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that died half-way
    tmp.parent.mkdir(parents=True, exist_ok=True)
    ds_to_universal(argparse.Namespace(input_folder=str(source), output_folder=str(tmp), num_extract_workers=1,
                                       num_merge_workers=1, keep_temp_folder=False, strict=True,
                                       inject_missing_state=False))
    (tmp.parent / "latest_universal").unlink(missing_ok=True)  # the converter's own marker: ours is the commit
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    write_atomic(target / COMMIT_FILE, json.dumps({"source": source.name, "files": files_of(target)}, indent=1))


def save(engine, ckpt_dir: Path, step: int, client_state: dict, writer: "SnapshotEngine | None" = None) -> str:
    """DeepSpeed's save on ALL ranks (it needs every rank's shards). Blocking (writer None): every rank's files are
    written and durable when it returns. Background: the state is captured in host memory and `writer` writes it."""
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    if writes_commits() and tag_dir.exists():  # left by an attempt that died mid-save
        shutil.rmtree(tag_dir)
    dist.barrier()
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={**client_state, **UNIVERSAL_INFO},
                               save_latest=False)
        if writer is None:
            fsync_tree(tag_dir)
    except OSError as err:
        raise StorageError(disk_error(ckpt_dir, tag, err)) from None
    return tag


def fsync_tree(tag_dir: Path) -> int:
    """fsyncs every file under tag_dir (what this rank wrote is durable) and returns their bytes."""
    total = 0
    for path in tag_dir.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
                total += os.fstat(f.fileno()).st_size
    return total


def disk_error(ckpt_dir: Path, tag: str, err: BaseException) -> str:
    """One line: the tag, what failed, and the volume with its room (torch.save reports a full disk as a
    RuntimeError of its zip writer, not as ENOSPC: the room says it)."""
    cause = err.strerror if isinstance(err, OSError) and err.strerror else error_line(err)
    try:
        usage = shutil.disk_usage(ckpt_dir)
        unit, scale = ("GiB", 2**30) if usage.total >= 2**30 else ("MiB", 2**20)
        room = f"{usage.free / scale:.1f} {unit} free of {usage.total / scale:.1f} {unit}"
        if usage.free < min(2**20, usage.total // 100 + 1):
            room = f"full: {room}"
    except OSError:
        room = "its size unknown"
    return (f"checkpoint {ckpt_dir / tag}: writing it failed ({cause}) on the checkpoint volume {ckpt_dir} "
            f"({room}); nothing of it is resumed from")


def commit(ckpt_dir: Path, step: int, keep: int, layout: dict, ds_config: dict, save_s: float) -> None:
    """Once every rank's files of the tag are durable: each directory's writer (writes_commits) records what its
    directory holds. The manifest records the owning release and identity, the layout and the ds_config (a resume
    checks and compares them)."""
    if not writes_commits():
        return
    tag_dir = ckpt_dir / tag_for(step)
    manifest = {"step": step, "release": release(), "owner": identity(), "save_s": round(save_s, 3), **layout,
                "storage": storage(), "ds_config": ds_config, "files": files_of(tag_dir)}
    write_atomic(tag_dir / COMMIT_FILE, json.dumps(manifest, indent=1))
    write_atomic(ckpt_dir / "latest", tag_dir.name)
    prune(ckpt_dir, keep)


def snapshot(value):
    """A copy of a state dict that training cannot change: every tensor copied into host memory (compact: a view
    keeps none of its base), containers rebuilt, anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the mapping's type and attributes (a state dict's _metadata)
        for key, item in value.items():
            out[key] = snapshot(item)
        return out
    if isinstance(value, list):
        return [snapshot(item) for item in value]
    if isinstance(value, tuple):
        items = [snapshot(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return copy.deepcopy(value)


class SnapshotEngine:
    """DeepSpeed's checkpoint engine (deepspeed.runtime.checkpoint_engine's interface) for background saves: save()
    captures the state in host memory and returns; write() hands what one save_checkpoint captured to a thread,
    which writes each file with the engine it replaces (torch.save) and fsyncs it. Loading is the replaced
    engine's."""

    def __init__(self, inner):
        self.inner = inner
        self.name = f"snapshot+{getattr(inner, 'name', type(inner).__name__)}"
        self.captured: list[tuple[object, str]] = []
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")

    def __getattr__(self, name):  # the rest of the interface (makedirs, load, is_data_parallel_writer, ...)
        return getattr(self.inner, name)

    def create(self, info) -> None:
        self.captured = []
        self.inner.create(info)

    def save(self, state_dict, path: str) -> None:
        self.captured.append((snapshot(state_dict), path))

    def commit(self, info) -> bool:
        return True  # the tag's commit is Checkpointer's, once every rank's writes are durable

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return False  # snapshot() copies each tensor compactly: DeepSpeed need not clone views first

    def write(self, tag_dir: Path) -> Future:
        captured, self.captured = self.captured, []
        return self.thread.submit(self._write, captured, tag_dir)

    def _write(self, captured: list, tag_dir: Path) -> int:
        for state, path in captured:
            self.inner.save(state, path)
        del captured
        total = fsync_tree(tag_dir)
        _fsync_dir(tag_dir)
        return total


class Checkpointer:
    """Owns the save cadence: every `every` steps (0: none on the way), at the last step, and when the ranks
    stop (SIGTERM). save() runs on every rank, as DeepSpeed needs; so does poll(), every step."""

    def __init__(self, engine, ckpt_dir: Path, every: int, keep: int, layout: dict, ds_config: dict,
                 start_step: int, background: bool = False):
        self.engine, self.ckpt_dir, self.every, self.keep = engine, ckpt_dir, every, keep
        self.layout, self.ds_config = layout, ds_config
        self.last_saved = start_step  # the newest committed step
        self.writer = None
        if background:
            self.writer = engine.checkpoint_engine = SnapshotEngine(engine.checkpoint_engine)
        self.in_flight: tuple[int, Future, float, float | None] | None = None  # step, its write, started, stall
        self.committed: list[dict] = []  # take_committed()'s

    def due(self, step: int, last_step: bool, stopping: bool) -> bool:
        return stopping or last_step or bool(self.every and step % self.every == 0)

    def save(self, step: int, client_state: dict, last_step: bool = False, stopping: bool = False
             ) -> tuple[Path, float] | None:
        """(the tag's dir, seconds the step loop waited) when a save is due at `step`, else None. A blocking save
        is committed when this returns; a background one when poll() says so."""
        if not self.due(step, last_step, stopping):
            return None
        rankstate.report("stopping" if stopping else "saving", step)  # a long save is not a hang
        started = time.perf_counter()
        self.poll(wait=True)  # the save in flight first: one at a time
        tag = save(self.engine, self.ckpt_dir, step, client_state, self.writer)
        if self.writer is None:
            dist.barrier()
            self._commit(step, started, size=None, stall=None)
            dist.barrier()
            return self.ckpt_dir / tag, time.perf_counter() - started
        background = not (stopping or last_step)  # the last word waits for its write
        stall = time.perf_counter() - started if background else None
        self.in_flight = (step, self.writer.write(self.ckpt_dir / tag), started, stall)
        if background:
            return self.ckpt_dir / tag, stall
        self.poll(wait=True)
        return self.ckpt_dir / tag, time.perf_counter() - started

    def take_committed(self) -> list[dict]:
        """What each commit since the previous call wrote, once: {step, bytes, write_s (from the save to the commit),
        stall_s (what the steps waited, for a background save; else None)}."""
        committed, self.committed = self.committed, []
        return committed

    def poll(self, wait: bool = False) -> bool:
        """Commits the save in flight once every rank's writes of it are durable (wait: waits for that), and
        returns whether it committed one (take_committed says what it wrote)."""
        if self.in_flight is None:
            return False
        step, future, started, stall = self.in_flight
        if wait:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - reported below, on every rank
                pass
        error = future.exception() if future.done() else None
        state = torch.tensor([(-1 if error else 1) if future.done() else 0], dtype=torch.int32,
                             device=self.engine.device)
        dist.all_reduce(state, op=dist.ReduceOp.MIN)
        if state.item() == 0:
            return False
        self.in_flight = None
        if state.item() < 0:
            tag = tag_for(step)
            raise StorageError(disk_error(self.ckpt_dir, tag, error) if error else
                               f"checkpoint {self.ckpt_dir / tag}: writing it failed on another rank (that rank's "
                               "line says why); nothing of it is resumed from", echo=error is None)
        self._commit(step, started, size=future.result(), stall=stall)
        return True

    def _commit(self, step: int, started: float, size: int | None, stall: float | None) -> None:
        write_s = time.perf_counter() - started
        commit(self.ckpt_dir, step, self.keep, self.layout, self.ds_config, write_s)
        self.last_saved = step
        self.committed.append({"step": step, "bytes": size, "write_s": write_s, "stall_s": stall})


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keeps the `keep` newest complete checkpoints and deletes every other tag, and universal copies of tags
    that are gone."""
    kept = 0
    for tag_dir in tags_newest_first(ckpt_dir):
        if kept < keep and is_complete(tag_dir):
            kept += 1
        else:
            shutil.rmtree(tag_dir, ignore_errors=True)
    universal = ckpt_dir / UNIVERSAL_DIR
    for converted in universal.iterdir() if universal.is_dir() else []:
        if converted.is_dir() and not (ckpt_dir / converted.name.lstrip(".").removesuffix(".tmp")).is_dir():
            shutil.rmtree(converted, ignore_errors=True)
