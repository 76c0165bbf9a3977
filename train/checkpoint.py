"""Checkpoints that a restarted job can trust.

DeepSpeed writes its `latest` marker with a plain write and, when it is missing, load_checkpoint quietly
starts from scratch. Here a checkpoint counts only once it is COMMITTED: every rank has written and
fsynced its shards, then rank 0 writes `commit.json` (the tag's file list and sizes) and replaces `latest`,
each atomically (temporary file, fsync, rename). Resume picks the newest committed tag whose files are
all there; a dir that holds checkpoints of which none is complete is an error, never a fresh start.
"""

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import deepspeed.comm as dist

COMMIT_FILE = "commit.json"
TAG_PATTERN = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """The checkpoint dir cannot be used as asked; names the dir and what is wrong."""


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


def _files(tag_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(tag_dir)): p.stat().st_size
            for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.name != COMMIT_FILE}


def check_writable(ckpt_dir: Path) -> None:
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # A unique name: ranks on other pods share the dir and often the same pid.
        with tempfile.NamedTemporaryFile(dir=ckpt_dir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise CheckpointError(f"checkpoint dir {ckpt_dir}: not writable ({err.strerror}); "
                              "mount a writable volume or pass another --checkpoint-dir") from None


def is_complete(tag_dir: Path) -> bool:
    try:
        manifest = json.loads((tag_dir / COMMIT_FILE).read_text())
        return all((tag_dir / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def tags_newest_first(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    tags = [p for p in ckpt_dir.iterdir() if p.is_dir() and TAG_PATTERN.match(p.name)]
    return sorted(tags, key=lambda p: int(TAG_PATTERN.match(p.name).group(1)), reverse=True)


def find_resume_tag(ckpt_dir: Path) -> tuple[str | None, list[str]]:
    """(newest complete tag or None, incomplete tags skipped on the way). Raises CheckpointError if the dir
    holds checkpoints but none of them is complete."""
    tags = tags_newest_first(ckpt_dir)
    skipped = []
    for tag_dir in tags:
        if is_complete(tag_dir):
            return tag_dir.name, skipped
        skipped.append(tag_dir.name)
    if tags:
        raise CheckpointError(
            f"checkpoint dir {ckpt_dir}: none of its {len(tags)} checkpoints is complete ({', '.join(skipped)}); "
            "refusing to start from scratch over them. Move them away to start fresh.")
    return None, []


def agree_on_resume_tag(ckpt_dir: Path, rank: int, world_size: int, zero_stage: int, logger) -> str | None:
    """The tag every rank resumes from. Rank 0 picks it; every rank then checks it sees that checkpoint
    complete (shared storage) and that it was written with this world size and ZeRO stage. Errors reach every
    rank, so none waits for a peer that gave up."""
    decision = [None]
    if rank == 0:
        try:
            tag, skipped = find_resume_tag(ckpt_dir)
            decision[0] = ("ok", tag, skipped)
        except CheckpointError as err:
            decision[0] = ("error", str(err), [])
    dist.broadcast_object_list(decision, src=0)
    verdict, tag, skipped = decision[0]
    if verdict == "error":
        raise CheckpointError(tag)
    for name in skipped:
        logger.warning(f"skipping incomplete checkpoint {ckpt_dir / name}")
    if tag is None:
        return None
    sees = [None] * world_size
    dist.all_gather_object(sees, is_complete(ckpt_dir / tag))
    missing = [r for r, ok in enumerate(sees) if not ok]
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt_dir / tag} is complete on rank 0 but not on rank(s) {missing}: the checkpoint dir "
            "must be one volume shared by all workers (checkpoints.existingClaim, a ReadWriteMany PVC)")
    manifest = json.loads((ckpt_dir / tag / COMMIT_FILE).read_text())
    saved = (manifest.get("world_size", world_size), manifest.get("zero_stage", zero_stage))
    if saved != (world_size, zero_stage):
        raise CheckpointError(
            f"checkpoint {ckpt_dir / tag} was written by {saved[0]} ranks with ZeRO stage {saved[1]}; this run has "
            f"{world_size} ranks and stage {zero_stage}. Resume with the same world size and stage, convert it "
            "(DeepSpeed's universal checkpoint or zero_to_fp32.py), or start in an empty checkpoint dir.")
    return tag


def save(engine, ckpt_dir: Path, step: int, client_state: dict, keep: int, world_size: int) -> str:
    """Saves on ALL ranks (DeepSpeed needs every rank's shards), then commits on rank 0."""
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    if dist.get_rank() == 0 and tag_dir.exists():  # left by an attempt that died mid-save
        shutil.rmtree(tag_dir)
    dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    for path in tag_dir.rglob("*"):  # shared storage: each rank makes sure what it wrote is durable
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    dist.barrier()
    if dist.get_rank() == 0:
        manifest = {"step": step, "world_size": world_size, "zero_stage": engine.zero_optimization_stage(),
                    "files": _files(tag_dir)}
        write_atomic(tag_dir / COMMIT_FILE, json.dumps(manifest, indent=1))
        write_atomic(ckpt_dir / "latest", tag)
        prune(ckpt_dir, keep)
    dist.barrier()
    return tag


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keeps the `keep` newest complete checkpoints and deletes every other tag."""
    kept = 0
    for tag_dir in tags_newest_first(ckpt_dir):
        if kept < keep and is_complete(tag_dir):
            kept += 1
        else:
            shutil.rmtree(tag_dir, ignore_errors=True)
