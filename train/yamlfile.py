"""Reading a hand-written YAML file strictly: one line naming the file (and line:column) for anything
unreadable, never a traceback. Shared by the train config (`--config`) and the values layers (scripts/)."""

from pathlib import Path

import yaml

MAX_NODES = 100_000  # an alias bomb expands past this long before it could be a real config file
MAX_DEPTH = 64
MAX_BYTES = 4 * 1024 * 1024  # hand-written configs are kilobytes; a device or a huge file never gets read whole


class YamlFileError(ValueError):
    """The file cannot be read as YAML; the message starts with the file's name."""


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate keys (YAML says they are an error; PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):  # `on:`/`yes:` are booleans in YAML 1.1, `1:` a number
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key_node.value!r} is read as {type(key).__name__}, not text: quote it",
                    key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _expanded_size(node, memo: dict, depth: int = 0) -> int:
    """How many nodes `node` becomes once its aliases are expanded (memoised: a bomb costs its node count)."""
    if id(node) in memo:
        if memo[id(node)] is None:
            raise yaml.composer.ComposerError(None, None, "an alias refers to itself", node.start_mark)
        return memo[id(node)]
    if depth > MAX_DEPTH:
        raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", node.start_mark)
    memo[id(node)] = None
    children = node.value if isinstance(node, yaml.SequenceNode) else (
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
    size = 1 + sum(_expanded_size(child, memo, depth + 1) for child in children)
    if size > MAX_NODES:
        raise yaml.composer.ComposerError(None, None, f"expands to more than {MAX_NODES:,} nodes (aliases of "
                                          "aliases?)", node.start_mark)
    memo[id(node)] = size
    return size


def read_text(path: Path, limit: int = MAX_BYTES) -> str:
    """A regular file's UTF-8 text, at most `limit` bytes; ValueError saying what is wrong otherwise."""
    try:
        if not path.is_file():
            raise ValueError("cannot read: " + ("not a regular file" if path.exists() else "no such file"))
        size = path.stat().st_size
        if size > limit:
            raise ValueError(f"{size:,} bytes; a config file is expected to be under {limit:,}")
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ValueError(f"cannot read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"byte {err.start}: not UTF-8 text") from None


def load_mapping(path: Path, name: str | None = None) -> dict:
    """The YAML (or JSON) mapping in `path`; {} for an empty file. `name` is how errors call the file."""
    name = name or str(path)
    try:
        text = read_text(Path(path))
    except ValueError as err:
        raise YamlFileError(f"{name}: {err}") from None
    loader = None
    try:
        loader = _StrictLoader(text)  # its reader refuses control characters at once
        node = loader.get_single_node()
        if node is None:
            return {}
        _expanded_size(node, {})
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        raise YamlFileError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
    except yaml.YAMLError as err:  # the reader's: a control character or an unreadable byte
        raise YamlFileError(f"{name}: YAML error: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise YamlFileError(f"{name}: nested too deeply") from None
    finally:
        if loader:
            loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise YamlFileError(f"{name}: expected a mapping at the top level, got {type(data).__name__}")
    return data
