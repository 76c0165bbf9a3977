"""Which checkpoints in a directory are complete: the one owner of that rule, for the train package's resume
(train/checkpoint.py) and for the platform's uploads and restores (objectstore.py). Reads go through
tenantfiles.Tree: a tenant's program writes these directories.

A tag is a directory whose name is in TAG_NAME's grammar: letters, digits and `_.+-`, starting with a letter or a
digit, at most 128 characters (so `.` and `..` never are, nor anything with a separator or a control character).
A directory outside it (a Lightning-style `epoch=3-step=10`) is skipped, and said once: never an error.

Three layouts are recognised, each by what its writer puts there last:
- the train package's `step_NNNNNNNN/`, complete once `commit.json` (its files and their sizes) is there and every
  file it lists has that size (train/checkpoint.py writes it after every rank's shards are durable);
- a Hugging Face Trainer's `checkpoint-N/`, complete once `trainer_state.json` is there (the Trainer writes it
  after the model, the optimizer and DeepSpeed's shards; on per-worker volumes each node's main process does);
- DeepSpeed's own `latest` at the directory's root naming a tag directory (engine.save_checkpoint writes it after
  the tag's files, on global rank 0).
"""

import errno
import os
import re
from dataclasses import dataclass

from podruntime.tenantfiles import Tree

# How the release's checkpoint directory is stored (the chart's DS_CHECKPOINT_STORAGE): one directory every rank
# shares, or a volume per worker holding its ranks' part of every tag.
STORAGE_ENV = "DS_CHECKPOINT_STORAGE"
SHARED, PER_WORKER = "shared", "per-worker"
TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
COMMIT_FILE = "commit.json"
TAG_PATTERN = re.compile(r"^step_(\d{8,})$")
TRAINER_PATTERN = re.compile(r"^checkpoint-(\d+)$")
DEEPSPEED_PATTERN = re.compile(r"^global_step(\d+)$")
NAMED_STEP = re.compile(r"^\D+(\d+)$")
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
MAX_COMMIT_BYTES = 64 << 20  # a commit record lists every file of a tag: thousands on a large run


def is_tag_name(name: str) -> bool:
    return bool(TAG_NAME.fullmatch(name))


def step_of(name: str) -> int | None:
    """The step a tag's name says: the number it ends with where that is its only one (`step_00000200`,
    `checkpoint-200`, DeepSpeed's `global_step200` and a program's own `save_checkpoint(tag=f"step{n}")`), else
    None (`epoch3-step10`, `final`)."""
    match = NAMED_STEP.match(name)
    return int(match.group(1)) if match else None


def of_a_known_layout(name: str) -> bool:
    """Whether a directory's name is a tag of the three layouts (not merely one ending in a number: a program's
    own `run2/` beside its tags is not one)."""
    return any(pattern.match(name) for pattern in (TAG_PATTERN, TRAINER_PATTERN, DEEPSPEED_PATTERN))


def order(tag: str) -> tuple[int, str]:
    """The sort key of a tag: its step, then its name (`step1000` is newer than `step950`, which a name's order
    would not say)."""
    step = step_of(tag)
    return (step if step is not None else -1), tag


def files_of(tree: Tree, tag: str) -> dict[str, int]:
    """Every regular file of the tag with its size, by path relative to it (links neither followed nor listed)."""
    return {path: info.st_size for path, info in tree.files(tag).items()}


# ---- what a copy of a tag sends (the bucket's uploads): what the volume holds, never more. A tenant's program chooses
# the files: a sparse file (`truncate -s 1T`) or a thousand hard links of one file would otherwise send their apparent
# size, once per name, on every save.
MAX_REGIONS = 1024  # data regions one file is sent as; more (holes every few blocks) are merged over the smallest holes


@dataclass(frozen=True)
class Sent:
    """How one file of a tag is sent: `link`, the first path of the same inode (sent once; a restore links the
    others to it); else `regions`, the (offset, length) data regions of a file with holes (None: the whole file)."""
    size: int
    link: str | None = None
    regions: tuple[tuple[int, int], ...] | None = None

    @property
    def data(self) -> int:
        """The bytes sent for it."""
        if self.link is not None:
            return 0
        return sum(length for _, length in self.regions) if self.regions is not None else self.size


def how_sent(tree: Tree, tag: str) -> dict[str, Sent]:
    """Every regular file of the tag (files_of's), each inode once and a file with holes by its data regions."""
    first: dict[tuple[int, int], str] = {}
    found = {}
    for relpath, info in tree.files(tag).items():
        inode = (info.st_dev, info.st_ino)
        if inode in first:
            found[relpath] = Sent(info.st_size, link=first[inode])
            continue
        first[inode] = relpath
        regions = None
        if info.st_blocks * 512 < info.st_size:  # maybe holes (compression lowers it too: SEEK_DATA tells)
            stream = tree.open_stream(f"{tag}/{relpath}")
            if stream is not None:
                with stream:
                    regions = data_regions(stream.fileno(), info.st_size)
        found[relpath] = Sent(info.st_size, regions=regions)
    return found


def data_regions(fd: int, size: int) -> tuple[tuple[int, int], ...] | None:
    """The file's data regions, at most MAX_REGIONS (merged over the smallest holes), or None: all data, or a
    filesystem that cannot say."""
    regions, offset = [], 0
    try:
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as err:
                if err.errno == errno.ENXIO:  # no data after offset
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            regions.append((start, end - start))
            offset = end
    except OSError:
        return None
    if regions == [(0, size)]:
        return None
    if len(regions) > MAX_REGIONS:
        holes = sorted(range(1, len(regions)), key=lambda i: regions[i][0] - sum(regions[i - 1]), reverse=True)
        kept = sorted(holes[:MAX_REGIONS - 1])
        merged, begin = [], 0
        for i in [*kept, len(regions)]:
            start = regions[begin][0]
            merged.append((start, sum(regions[i - 1]) - start))
            begin = i
        regions = merged
    return tuple(regions)


def layout_record(layout: dict[str, Sent]) -> dict:
    """How a copy was sent, for its manifest (the bucket's part, the peer copy's header): {files: {path: size},
    links: {path: first path}, regions: {path: [[offset, length], ...]}}."""
    return {"files": {relpath: sent.size for relpath, sent in layout.items()},
            "links": {relpath: sent.link for relpath, sent in layout.items() if sent.link is not None},
            "regions": {relpath: [list(r) for r in sent.regions] for relpath, sent in layout.items()
                        if sent.regions is not None}}


def layout_of(record: dict) -> dict[str, Sent] | None:
    """A layout_record back (the receiving side's: a part's manifest, a peer copy's header), checked against its
    files: None when a size is not a whole number, a link names a path it does not list (or another link, or a file
    of another size), or a file's regions are not ordered, apart and within it."""
    files, links, regions = record.get("files"), record.get("links", {}), record.get("regions", {})
    if not isinstance(files, dict) or not isinstance(links, dict) or not isinstance(regions, dict) or \
            not all(type(size) is int and size >= 0 for size in files.values()):
        return None
    for path, target in links.items():
        if path not in files or target not in files or target in links or files[path] != files[target]:
            return None
    checked = {}
    for path, spans in regions.items():
        if path not in files or path in links or not isinstance(spans, list) or len(spans) > MAX_REGIONS:
            return None
        end = 0
        for span in spans:
            if not (isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)):
                return None
            if span[0] < end or span[1] <= 0 or span[0] + span[1] > files[path]:
                return None
            end = span[0] + span[1]
        checked[path] = tuple((o, n) for o, n in spans)
    return {relpath: Sent(size, links.get(relpath), checked.get(relpath)) for relpath, size in files.items()}


def is_complete(tree: Tree, tag: str) -> bool:
    """A train package tag: its commit.json lists files that are all there with their sizes."""
    manifest = tree.read_json(f"{tag}/{COMMIT_FILE}", MAX_COMMIT_BYTES)
    files = manifest.get("files") if manifest else None
    if not isinstance(files, dict):
        return False
    for name, size in files.items():
        info = tree.stat(f"{tag}/{name}") if isinstance(name, str) else None
        if info is None or not isinstance(size, int) or info.st_size != size:
            return False
    return True


def latest(tree: Tree) -> str | None:
    """The tag DeepSpeed's `latest` names (a regular file of one line in the tag grammar), or None."""
    text = (tree.read_text(LATEST, 256) or "").strip()
    return text if is_tag_name(text) else None


def tags_newest_first(tree: Tree) -> list[str]:
    """The train package's tag directories, complete or not, newest first."""
    return sorted((name for name in tree.dirs(pattern=TAG_PATTERN)), key=order, reverse=True)


def complete_tags(tree: Tree) -> list[str]:
    """The complete checkpoints of every layout directly under the tree, newest first (by step, then name)."""
    found = set()
    for name in tree.dirs():
        if not is_tag_name(name):
            if not name.startswith(".") and name != "_job" and tree.log is not None:
                tree.log.once(f"tag-grammar {tree.root}/{name}", f"{tree.path()}: skipped {name!r}: not a checkpoint "
                              "tag name (letters, digits and _.+- only)")
            continue
        if TAG_PATTERN.match(name) and is_complete(tree, name):
            found.add(name)
        elif TRAINER_PATTERN.match(name) and tree.is_file(f"{name}/{TRAINER_STATE}"):
            found.add(name)
    named = latest(tree)
    if named and named not in found and not TAG_PATTERN.match(named) and tree.is_dir(named):
        found.add(named)  # DeepSpeed's own layout (the train package's tags count by their commit only)
    return sorted(found, key=order, reverse=True)


def merge_commits(manifests: list[dict]) -> dict:
    """One train package commit.json for a tag whose parts several per-worker volumes committed (each listing its
    own files): the first part's fields with every part's files."""
    merged = dict(manifests[0])
    merged["files"] = {name: size for manifest in manifests for name, size in manifest["files"].items()}
    return merged
