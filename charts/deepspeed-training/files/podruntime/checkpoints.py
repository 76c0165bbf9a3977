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

import re

from podruntime.tenantfiles import Tree

TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
COMMIT_FILE = "commit.json"
TAG_PATTERN = re.compile(r"^step_(\d{8,})$")
TRAINER_PATTERN = re.compile(r"^checkpoint-(\d+)$")
DEEPSPEED_PATTERN = re.compile(r"^global_step(\d+)$")
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
MAX_COMMIT_BYTES = 64 << 20  # a commit record lists every file of a tag: thousands on a large run


def is_tag_name(name: str) -> bool:
    return bool(TAG_NAME.fullmatch(name))


def step_of(name: str) -> int | None:
    """The step a tag's name says (`step_00000200`, `checkpoint-200`, DeepSpeed's `global_step200`), else None."""
    for pattern in (TAG_PATTERN, TRAINER_PATTERN, DEEPSPEED_PATTERN):
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def order(tag: str) -> tuple[int, str]:
    """The sort key of a tag: its step, then its name."""
    step = step_of(tag)
    return (step if step is not None else -1), tag


def files_of(tree: Tree, tag: str) -> dict[str, int]:
    """Every regular file of the tag with its size, by path relative to it (links neither followed nor listed)."""
    return {path: info.st_size for path, info in tree.files(tag).items()}


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
