"""Which checkpoints in a directory are complete: the one owner of that rule, for the train package's resume
(train/checkpoint.py) and for the chart's object-store uploads and restores (files/objectstore.py, which runs a
byte copy of this module from the scripts' `generated/`, written by scripts/chart_data.py). Standard library only.

Three layouts are recognised, each by what its writer puts there last:
- the train package's `step_NNNNNNNN/`, complete once `commit.json` (its files and their sizes) is there and every
  file it lists has that size (train/checkpoint.py writes it after every rank's shards are durable);
- a Hugging Face Trainer's `checkpoint-N/`, complete once `trainer_state.json` is there (the Trainer writes it
  after the model, the optimizer and DeepSpeed's shards; on per-worker volumes each node's main process does);
- DeepSpeed's own `latest` at the directory's root naming a tag directory (engine.save_checkpoint writes it after
  the tag's files, on global rank 0).
"""

import json
import os
import re
import stat
from pathlib import Path

COMMIT_FILE = "commit.json"
TAG_PATTERN = re.compile(r"^step_(\d{8,})$")
TRAINER_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"


def files_of(tag_dir: Path) -> dict[str, int]:
    """Every regular file under tag_dir with its size, by path relative to it; links are neither followed nor
    listed (a tenant's program writes these directories)."""
    found: dict[str, int] = {}
    pending = [tag_dir]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                pending.append(Path(entry.path))
            elif stat.S_ISREG(info.st_mode):
                found[str(Path(entry.path).relative_to(tag_dir))] = info.st_size
    return dict(sorted(found.items()))


MAX_RECORD_BYTES = 64 << 20


def read_small(path: Path, limit: int = MAX_RECORD_BYTES) -> bytes | None:
    """A regular file's first `limit` bytes, opened without following a link and without blocking (a FIFO planted
    in a checkpoint directory must not hang its reader); None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def is_complete(tag_dir: Path) -> bool:
    """A train package tag: its commit.json lists files that are all there with their sizes."""
    try:
        manifest = json.loads(read_small(tag_dir / COMMIT_FILE) or b"")
        return all((tag_dir / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def tags_newest_first(ckpt_dir: Path) -> list[Path]:
    """The train package's tag directories, complete or not, newest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p for p in ckpt_dir.iterdir() if p.is_dir() and TAG_PATTERN.match(p.name)]
    return sorted(tags, key=lambda p: int(TAG_PATTERN.match(p.name).group(1)), reverse=True)


def step_of(name: str) -> int | None:
    """The step a tag's name says (`step_00000200`, `checkpoint-200`, DeepSpeed's `global_step200`), else None."""
    for pattern in (TAG_PATTERN, TRAINER_PATTERN, re.compile(r"^global_step(\d+)$")):
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def complete_tags(ckpt_dir: Path) -> list[str]:
    """The complete checkpoints of every layout directly under ckpt_dir, newest first (by step, then name)."""
    if not ckpt_dir.is_dir() or ckpt_dir.is_symlink():
        return []
    found = set()
    for entry in os.scandir(ckpt_dir):
        if not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if TAG_PATTERN.match(entry.name) and is_complete(path):
            found.add(entry.name)
        elif TRAINER_PATTERN.match(entry.name) and read_small(path / TRAINER_STATE, 1) is not None:
            found.add(entry.name)
    latest = (read_small(ckpt_dir / LATEST, 256) or b"").decode(errors="replace").strip()
    if latest and "/" not in latest and latest not in found and (ckpt_dir / latest).is_dir() \
            and not (ckpt_dir / latest).is_symlink() and not TAG_PATTERN.match(latest):
        found.add(latest)  # DeepSpeed's own layout (the train package's tags count by their commit only)
    return sorted(found, key=lambda name: (step_of(name) or -1, name), reverse=True)


def merge_commits(manifests: list[dict]) -> dict:
    """One train package commit.json for a tag whose parts several per-worker volumes committed (each listing its
    own files): the first part's fields with every part's files."""
    merged = dict(manifests[0])
    merged["files"] = {name: size for manifest in manifests for name, size in manifest["files"].items()}
    return merged
