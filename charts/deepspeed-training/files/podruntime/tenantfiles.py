"""The one set of rules for every read and write of a directory a tenant's program can write: the pod's state
directory (the ranks' state lines, progress, end records), the checkpoint volume (tags, `latest`, commit records)
and the chart's records beside them (the ledger, goodput, diagnostics). What a tenant's program wrote there is
hostile input to the platform's containers, which hold the token and the bucket's keys.

- Paths: a Tree is a directory reached from `/` one component at a time without following a link (O_NOFOLLOW on
  each component): a link anywhere on the way is refused, also one planted where the platform expects its own
  directory. Paths below it are relative; a component that is empty, `.`, `..` or holds a NUL is refused.
- Records (small files: progress, end records, verdicts, `latest`, `commit.json`, manifests): `read`/`read_json`
  take regular files only, opened without blocking (a FIFO or a device answers at once, and is refused), read up
  to a bound; JSON is bounded in size and depth as well. Nothing raises: a refused record is None, and why is said
  once (a missing one is simply None).
- Checkpoint files: `open_stream` opens them the same way for the uploader, which checks their size again after.
- Writes (`write`, `mkdir`, `rename`, `link`, `remove`): beneath the root, through directory descriptors; a file is
  replaced whole through a fresh temporary name (a planted link is replaced, never written through), a tree is
  removed without following links. They return whether they succeeded; what failed is said once.

Every pod program opens what lies under those directories through this module and no other way (a test reads the
package's code for it); /proc, /sys and the termination log are host.py's.
"""

import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

MAX_RECORD_BYTES = 64 * 1024  # a record: progress, a verdict, an end record, a hang report, a commit record
MAX_DEPTH = 32  # nesting of a JSON record
MAX_NAMES = 4096  # entries of one directory a listing looks at
MAX_FILES = 200_000  # regular files a walk of one tree lists

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def parts_of(relpath) -> list[str] | None:
    """The components of a relative path, or None when one is empty, `.`, `..` or holds a NUL ("" is the root)."""
    text = str(relpath)
    if text in ("", "."):
        return []
    parts = text.split("/")
    if any(part in ("", ".", "..") or "\0" in part for part in parts):
        return None
    return parts


def json_depth_ok(value, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests no deeper than `limit` (iteratively: a deep value cannot exhaust the stack here)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return True


def parse_json(data: bytes | str, limit: int = MAX_RECORD_BYTES) -> tuple[object, str]:
    """(the JSON value, "") or (None, why not): bounded in size and depth, never raises (json's own recursion on a
    deep document is caught, then the depth is checked again for whoever walks the value next)."""
    if len(data) > limit:
        return None, f"larger than {limit} bytes"
    try:
        value = json.loads(data.decode("utf-8", "replace") if isinstance(data, bytes) else data)
    except (ValueError, RecursionError):
        return None, "not JSON within the depth bound"
    if not json_depth_ok(value):
        return None, f"nested deeper than {MAX_DEPTH}"
    return value, ""


class Tree:
    """A directory reached without following a link, and everything done beneath it (see the module's rules).
    `log`, if given (a text.Log), says once why a record was refused or a write failed."""

    def __init__(self, root, log=None, trusted_root: bool = False):
        """`trusted_root`: the root's own path may run through links (a program's own directory, which the train
        package reads for itself); everything beneath it is still reached without following one."""
        self.root = Path(os.path.realpath(root) if trusted_root else os.path.abspath(root))
        self.log = log
        self.error = ""  # why the last write, rename or removal failed

    def __repr__(self) -> str:
        return f"Tree({str(self.root)!r})"

    def subtree(self, relpath) -> "Tree":
        """The tree at relpath (a name the platform chose: ValueError for one that is not a relative path)."""
        parts = parts_of(relpath)
        if parts is None:
            raise ValueError(f"not a relative path: {relpath!r}")
        return Tree(self.root.joinpath(*parts), self.log)

    def path(self, relpath="") -> Path:
        """Where `relpath` lies, for a person (never opened by this path)."""
        return self.root / str(relpath) if str(relpath) not in ("", ".") else self.root

    # ---- opening, without following a link

    def _say(self, relpath, why: str, error: str = "") -> None:
        self.error = error or why
        if self.log is not None:
            self.log.once(f"{self.root}/{relpath}: {why}", f"{self.path(relpath)}: {why}")

    def _open_dir(self, parts: list[str], create: bool = False) -> int | None:
        """A descriptor of root/parts (made on the way when `create`), or None."""
        fd = None
        try:
            fd = os.open("/", _DIR)
            for part in [*self.root.parts[1:], *parts]:
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                    child = os.open(part, _DIR, dir_fd=fd)
                os.close(fd)
                fd = child
            return fd
        except (OSError, ValueError) as err:
            if fd is not None:
                os.close(fd)
            if getattr(err, "errno", None) in (errno.ELOOP, errno.ENOTDIR):
                self._say("/".join(parts), "a link or not a directory on the way: refused")
            return None

    def _parent(self, relpath, create: bool = False) -> tuple[int, str] | None:
        """(a descriptor of relpath's directory, its last component), or None (relpath must name something)."""
        parts = parts_of(relpath)
        if not parts:
            return None
        fd = self._open_dir(parts[:-1], create)
        return (fd, parts[-1]) if fd is not None else None

    def _open_file(self, relpath) -> int | None:
        """A regular file, opened without following a link and without blocking (then set blocking), or None."""
        found = self._parent(relpath)
        if found is None:
            return None
        directory, name = found
        try:
            fd = os.open(name, _FILE, dir_fd=directory)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO):
                self._say(relpath, "a link or a FIFO: refused")
            return None
        finally:
            os.close(directory)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._say(relpath, "not a regular file: refused")
                os.close(fd)
                return None
            os.set_blocking(fd, True)
            return fd
        except OSError:
            os.close(fd)
            return None

    # ---- reading

    def read_with_mtime(self, relpath, limit: int = MAX_RECORD_BYTES) -> tuple[bytes, float] | None:
        """(up to `limit` bytes of the regular file, its mtime), or None."""
        fd = self._open_file(relpath)
        if fd is None:
            return None
        try:
            mtime, chunks, left = os.fstat(fd).st_mtime, [], limit
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks), mtime
        except OSError:
            return None
        finally:
            os.close(fd)

    def read(self, relpath, limit: int = MAX_RECORD_BYTES) -> bytes | None:
        found = self.read_with_mtime(relpath, limit)
        return found[0] if found else None

    def read_text(self, relpath, limit: int = MAX_RECORD_BYTES) -> str | None:
        found = self.read(relpath, limit)
        return found.decode("utf-8", "replace") if found is not None else None

    def read_json(self, relpath, limit: int = MAX_RECORD_BYTES, kind: type = dict):
        """The JSON value of `kind` in the file, or None: a larger file, another type, bad or too deep JSON is
        refused whole, and said once."""
        found = self.read(relpath, limit + 1)
        if found is None:
            return None
        value, why = parse_json(found, limit)
        if why or not isinstance(value, kind):
            self._say(relpath, why or f"not a JSON {kind.__name__}: refused")
            return None
        return value

    def stat(self, relpath):
        """lstat of relpath (a link is not followed: its own stat), or None."""
        found = self._parent(relpath)
        if found is None:
            return None
        directory, name = found
        try:
            return os.stat(name, dir_fd=directory, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(directory)

    def is_file(self, relpath) -> bool:
        info = self.stat(relpath)
        return info is not None and stat.S_ISREG(info.st_mode)

    def is_dir(self, relpath="") -> bool:
        if parts_of(relpath) == []:
            fd = self._open_dir([])
        else:
            parts = parts_of(relpath)
            fd = self._open_dir(parts) if parts else None
        if fd is None:
            return False
        os.close(fd)
        return True

    def entries(self, relpath="", pattern: re.Pattern | None = None, limit: int = MAX_NAMES) -> dict[str, str]:
        """{name: "file" | "dir" | "other"} of the directory's entries (those `pattern` matches whole), at most
        `limit`; a link is "other"."""
        parts = parts_of(relpath)
        fd = self._open_dir(parts) if parts is not None else None
        if fd is None:
            return {}
        found = {}
        try:
            with os.scandir(fd) as listing:
                for entry in listing:
                    if pattern is not None and not pattern.fullmatch(entry.name):
                        continue
                    if entry.is_symlink():
                        kind = "other"
                    elif entry.is_dir(follow_symlinks=False):
                        kind = "dir"
                    else:
                        kind = "file" if entry.is_file(follow_symlinks=False) else "other"
                    found[entry.name] = kind
                    if len(found) >= limit:
                        break
        except OSError:
            pass
        finally:
            os.close(fd)
        return dict(sorted(found.items()))

    def names(self, relpath="", pattern: re.Pattern | None = None, limit: int = MAX_NAMES) -> list[str]:
        return list(self.entries(relpath, pattern, limit))

    def dirs(self, relpath="", pattern: re.Pattern | None = None) -> list[str]:
        return [name for name, kind in self.entries(relpath, pattern).items() if kind == "dir"]

    def files(self, relpath="", limit: int = MAX_FILES) -> dict[str, os.stat_result]:
        """Every regular file under relpath, by path relative to it, with its lstat; links are neither followed nor
        listed, and at most `limit` files are."""
        parts = parts_of(relpath)
        if parts is None:
            return {}
        found, pending = {}, [[]]
        while pending and len(found) < limit:
            below = pending.pop()
            fd = self._open_dir([*parts, *below])
            if fd is None:
                continue
            try:
                with os.scandir(fd) as listing:
                    for entry in listing:
                        info = entry.stat(follow_symlinks=False)
                        if stat.S_ISDIR(info.st_mode):
                            pending.append([*below, entry.name])
                        elif stat.S_ISREG(info.st_mode) and len(found) < limit:
                            found["/".join([*below, entry.name])] = info
            except OSError:
                pass
            finally:
                os.close(fd)
        return dict(sorted(found.items()))

    def free_bytes(self) -> int | None:
        """Bytes an unprivileged writer may still put on the root's filesystem, or None."""
        fd = self._open_dir([])
        if fd is None:
            return None
        try:
            info = os.fstatvfs(fd)
            return info.f_bavail * info.f_frsize
        except OSError:
            return None
        finally:
            os.close(fd)

    def open_stream(self, relpath):
        """A checkpoint file for streaming (binary, read-only): regular, opened beneath without following a link and
        without blocking; None otherwise. The caller checks its size again once it has read it."""
        fd = self._open_file(relpath)
        return os.fdopen(fd, "rb") if fd is not None else None

    def poke_fifo(self, relpath, data: bytes) -> bool:
        """Writes `data` to the FIFO relpath if a reader holds it open (a rank's diagnostics thread), without
        blocking and without following a link; False for anything else (no reader, a regular file, a link)."""
        found = self._parent(relpath)
        if found is None:
            return False
        directory, name = found
        try:
            fd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        except OSError:
            return False
        finally:
            os.close(directory)
        try:
            return stat.S_ISFIFO(os.fstat(fd).st_mode) and os.write(fd, data) == len(data)
        except OSError:
            return False
        finally:
            os.close(fd)

    # ---- writing

    def mkdir(self, relpath="", exclusive: bool = False) -> bool:
        """root/relpath and every directory on the way, made where absent; `exclusive`: False when relpath was
        already there (two callers never both make it)."""
        parts = parts_of(relpath)
        if exclusive and parts:
            found = self._parent(relpath, create=True)
            if found is None:
                return False
            try:
                os.mkdir(found[1], dir_fd=found[0])
                return True
            except OSError:
                return False
            finally:
                os.close(found[0])
        fd = self._open_dir(parts, create=True) if parts is not None else None
        if fd is None:
            self._say(relpath, "cannot be made")
            return False
        os.close(fd)
        return True

    def write(self, relpath, data: bytes | str, mode: int = 0o644, exclusive: bool = False) -> bool:
        """Replaces the file relpath whole (its directories made where absent): a reader sees the old file or the
        new one, never half. `exclusive`: only if nothing is there yet."""
        found = self._parent(relpath, create=True)
        if found is None:
            self._say(relpath, "cannot be written")
            return False
        directory, name = found
        tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                          dir_fd=directory)
            try:
                view = memoryview(data.encode() if isinstance(data, str) else data)
                while view:
                    view = view[os.write(out, view):]
                os.fchmod(out, mode)
            finally:
                os.close(out)
            if exclusive:
                os.link(tmp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
                os.unlink(tmp, dir_fd=directory)
            else:
                os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
            return True
        except OSError as err:
            try:
                os.unlink(tmp, dir_fd=directory)
            except OSError:
                pass
            if not (exclusive and err.errno == errno.EEXIST):
                self._say(relpath, f"cannot be written ({err.strerror})", err.strerror)
            return False
        finally:
            os.close(directory)

    def create(self, relpath, mode: int = 0o644):
        """A new regular file for streaming into (binary; its directories made where absent): only where nothing is
        there yet (a planted file or link makes it None, never written through)."""
        found = self._parent(relpath, create=True)
        if found is None:
            self._say(relpath, "cannot be created")
            return None
        directory, name = found
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=directory)
        except OSError as err:
            self._say(relpath, f"cannot be created ({err.strerror})")
            return None
        finally:
            os.close(directory)
        return os.fdopen(fd, "wb")

    def _across(self, source, target, failed: str, act) -> bool:
        """act(source's (directory fd, name), target's) for an operation on two paths beneath the root (target's
        directories made where absent); an OSError is said once, as `target cannot be <failed> source`."""
        src, dst = self._parent(source), self._parent(target, create=True)
        try:
            return src is not None and dst is not None and act(src, dst)
        except OSError as err:
            self._say(target, f"cannot be {failed} {source} ({err.strerror})")
            return False
        finally:
            for found in (src, dst):
                if found is not None:
                    os.close(found[0])

    def rename(self, source, target) -> bool:
        """Renames source to target, both beneath the root (target's directories made where absent)."""
        def act(src, dst) -> bool:
            os.rename(src[1], dst[1], src_dir_fd=src[0], dst_dir_fd=dst[0])
            return True
        return self._across(source, target, "renamed from", act)

    def link(self, source, target) -> bool:
        """A hard link at target (a new name: nothing there is replaced) to the regular file at source, both
        beneath the root; neither is followed if it is a link."""
        def act(src, dst) -> bool:
            if not stat.S_ISREG(os.stat(src[1], dir_fd=src[0], follow_symlinks=False).st_mode):
                self._say(source, "not a regular file: not linked")
                return False
            os.link(src[1], dst[1], src_dir_fd=src[0], dst_dir_fd=dst[0], follow_symlinks=False)
            return True
        return self._across(source, target, "linked to", act)

    def remove(self, relpath) -> bool:
        """Removes relpath, a file, a link (not what it points to) or a whole tree (no link below it followed);
        True when nothing is there any more."""
        found = self._parent(relpath)
        if found is None:  # its directory is not there (or is a link, which leads nowhere of the tree's)
            return bool(parts_of(relpath))
        directory, name = found
        try:
            info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(name, dir_fd=directory)
            else:
                os.unlink(name, dir_fd=directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as err:
            self._say(relpath, f"cannot be removed ({err.strerror})")
            return False
        finally:
            os.close(directory)

    def touch(self, relpath) -> bool:
        """Makes relpath an empty regular file if nothing is there (a marker); never opens what is there."""
        return self.write(relpath, b"", exclusive=True) or self.is_file(relpath)

    def prune(self, relpath, keep: int, spare: str = "") -> None:
        """Removes all but the `keep` newest entries (by mtime) of the directory relpath, never `spare` nor a name
        starting with a dot."""
        entries = [name for name in self.names(relpath) if name != spare and not name.startswith(".")]
        dated = sorted(((info.st_mtime if (info := self.stat(f"{relpath}/{name}" if relpath else name)) else 0.0),
                        name) for name in entries)
        for _, name in dated[:max(0, len(dated) - keep)]:
            self.remove(f"{relpath}/{name}" if relpath else name)
