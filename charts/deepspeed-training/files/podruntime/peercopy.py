"""The peer copy (chart value checkpoints.peerCopy, on wherever the storage is per-worker): each worker's newest
complete part of a checkpoint is also kept on one other worker's volume, a ring in which worker i keeps worker i+1's
(the last worker keeps worker 0's), so that losing any one pod or node, whose volume goes with it, costs no
checkpoint.

- The keeper (Keeper: a thread of each worker's loop, nossh, or agent, ssh, on DS_PEER_COPY_PORT) takes the part its
  ring neighbour sends and keeps one copy, in <volume>/_job/peer/<node>/<tag>/ with copy.json (the files, their
  sizes, links and data regions: checkpoints.layout_record) written after it: a cut copy (.incoming-<tag>) is never
  held. It serves that copy back to a new pod of that worker.
- The sender (Replicator, a thread beside it) sends this volume's newest complete tag (checkpoints.complete_tags)
  once it is committed, in the background, one copy in flight; it asks its keeper what it holds from time to time
  and sends again when the keeper lost it (a new pod). After a SIGTERM it sends the stop's checkpoint within the
  grace period that is left (flush).
- Before each attempt every host's holdings (its complete tags, the copy it keeps) reach the ledger's owner, which
  picks the newest tag that every worker holds on its own volume or through its keeper (plan): never a mix of tags,
  never a start from step 0 while a worker holds a checkpoint. Each worker then prepares (prepare): it fetches its
  part from its keeper where its own volume lacks the tag, sets aside the tags newer than it (a program that resumes
  from the newest directory, a Trainer's, would otherwise mix steps) and names it in `latest` where the layout has
  one.

Wire: one request per TCP connection: a JSON line ({v: protocol.VERSION, m, release, node, ...}); the answer is a JSON
line; a `put` is answered `ready` before its files' data follow (in the order its header lists them; what the volume
holds, checkpoints.how_sent: a hard link once, a file's data regions only) and then `ok`; a `get` is answered with the
files' list and their data. What a keeper receives is a tenant's checkpoint: written
through tenantfiles.Tree (no link followed, nothing outside the copy's directory, regular files only), its sizes
checked, refused whole when it would not leave ROOM_MARGIN free. Only the release's own pods reach the port (the
chart's NetworkPolicy; without it the chart turns the peer copy off).
"""

import json
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

from podruntime import channel, checkpoints, host, protocol
from podruntime.channel import listen
from podruntime.tenantfiles import Tree, parse_json, parts_of
from podruntime.text import Log, clean

PORT_ENV = "DS_PEER_COPY_PORT"
COPIES = f"{protocol.JOB_DIR}/{protocol.PEER}"
ASIDE = f"{protocol.JOB_DIR}/{protocol.ASIDE}"
RESTORED = f"{protocol.JOB_DIR}/{protocol.RESTORED}"
RECORD = "copy.json"
INCOMING = ".incoming-"  # a copy being received: renamed into place when whole
FETCHING = ".fetching-"  # a part being fetched back from the keeper: the same
HEADER_BYTES = checkpoints.MAX_COMMIT_BYTES  # a copy's header lists every file of the part
MAX_FILES = 100_000
CHUNK = 1 << 20
POLL_S = 2.0
VERIFY_S = 15.0  # how often a sender asks its keeper whether it still holds the copy (a new keeper pod holds none)
IO_TIMEOUT_S = 60.0
CONNECT_S = 5.0
BACKOFF_MAX_S = 30.0
ROOM_MARGIN = 64 << 20  # a copy leaves this much of the keeper's volume free: its own next save needs room too
STOP_MARGIN_S = 10.0  # the pod's grace period beyond the ranks' (the chart's killGraceSeconds)
HOLDINGS_TAGS = 16  # a host's newest complete tags that its holdings list
CONNECTIONS = 4  # requests a keeper serves at once

log = Log("peer-copy")


class PeerError(Exception):
    """A request the keeper refused or could not finish: one line."""


def keeper_of(node: int, nodes: int) -> int:
    """The worker whose volume keeps `node`'s copy."""
    return (node - 1) % nodes


def kept_by(node: int, nodes: int) -> int:
    """The worker whose copy `node`'s volume keeps."""
    return (node + 1) % nodes


@dataclass
class Ring:
    node: int
    hosts: list[str]
    port: int
    release: str

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    @property
    def keeper(self) -> int:
        return keeper_of(self.node, self.nodes)

    @property
    def kept(self) -> int:
        return kept_by(self.node, self.nodes)

    def name(self, node: int) -> str:
        """A worker's host as a person knows it: its pod's name (the hostfile's first label), else its address."""
        entry = self.hosts[node]
        return entry if entry.replace(".", "").isdigit() or ":" in entry else entry.split(".")[0]

    @classmethod
    def from_env(cls, hosts: list[str], node: int | None = None, env=os.environ) -> "Ring | None":
        """This worker's place in the ring, or None: the peer copy is off (no port: the chart's switch), one worker,
        or this host not in the hostfile."""
        text = env.get(PORT_ENV, "") or ""
        port = int(text) if text.isdigit() and 0 < int(text) < 65536 else 0
        if not port or len(hosts) < 2:
            return None
        if node is None:
            name = host.hostname()
            node = next((i for i, entry in enumerate(hosts) if entry.split(".")[0] == name), None)
        return cls(node, hosts, port, env.get("DS_RELEASE", "")) if node is not None and node < len(hosts) else None


def volume_of(env=os.environ) -> Tree:
    return Tree(env.get("DS_CHECKPOINT_DIR", "/checkpoints"), log)


# ---- the wire

def line(kind: str, **fields) -> bytes:
    return (json.dumps({"v": protocol.VERSION, "m": kind, **fields}, separators=(",", ":")) + "\n").encode()


def read_line(reader, limit: int = HEADER_BYTES) -> dict | None:
    """One JSON line of the other end's, typed: a dict of this protocol version, else None."""
    data = reader.readline(limit + 1)
    if not data.endswith(b"\n"):
        return None
    value, why = parse_json(data, limit)
    return value if not why and isinstance(value, dict) and value.get("v") == protocol.VERSION else None


def valid_files(files) -> dict[str, int] | None:
    """A copy's files ({relative path: size}), typed: paths of plain components, sizes whole and not negative."""
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        return None
    for relpath, size in files.items():
        if not isinstance(relpath, str) or not parts_of(relpath) or type(size) is not int or size < 0:
            return None
    return files


def valid_tag(tag) -> str | None:
    return tag if isinstance(tag, str) and checkpoints.is_tag_name(tag) else None


def spans(sent: "checkpoints.Sent") -> tuple[tuple[int, int], ...]:
    """The (offset, length) spans of a file that are sent: its data regions, or the whole file."""
    return sent.regions if sent.regions is not None else ((0, sent.size),) if sent.size else ()


def send_files(sock: socket.socket, volume: Tree, base: str, layout: dict[str, "checkpoints.Sent"]) -> int:
    """Each file's data, in order (sendfile: no copy through Python; a hard link is not sent again, a file's holes
    not at all); PeerError when one changed meanwhile."""
    for relpath, sent in layout.items():
        if sent.link is not None:
            continue
        stream = volume.open_stream(f"{base}/{relpath}")
        if stream is None:
            raise PeerError(f"{base}/{relpath} went away while it was being copied")
        with stream:
            if os.fstat(stream.fileno()).st_size != sent.size or any(
                    sock.sendfile(stream, offset, length) != length for offset, length in spans(sent)):
                raise PeerError(f"{base}/{relpath} changed size while it was being copied")
    return sum(sent.data for sent in layout.values())


def receive_files(reader, volume: Tree, base: str, layout: dict[str, "checkpoints.Sent"]) -> int:
    """Each file's data into base/<path> (new files only: nothing there is written through), its holes made again,
    then its hard links; fsync'd. PeerError when the stream is cut or a file cannot be made."""
    for relpath, sent in layout.items():
        if sent.link is not None:
            continue
        out = volume.create(f"{base}/{relpath}")
        if out is None:
            raise PeerError(f"{volume.path(base)}/{relpath}: cannot be written ({volume.error})")
        with out:
            for offset, length in spans(sent):
                out.seek(offset)
                left = length
                while left:
                    chunk = reader.read(min(CHUNK, left))
                    if not chunk:
                        raise PeerError(f"the copy was cut at {relpath} ({length - left} of {length} bytes)")
                    out.write(chunk)
                    left -= len(chunk)
            out.truncate(sent.size)
            out.flush()
            os.fsync(out.fileno())
    for relpath, sent in layout.items():
        if sent.link is not None and not volume.link(f"{base}/{sent.link}", f"{base}/{relpath}"):
            raise PeerError(f"{volume.path(base)}/{relpath}: cannot be linked to {sent.link} ({volume.error})")
    return sum(sent.data for sent in layout.values())


def valid_layout(record: dict) -> dict[str, "checkpoints.Sent"] | None:
    """A copy's layout from its header or record (checkpoints.layout_record: files, links, regions), typed."""
    return checkpoints.layout_of(record) if valid_files(record.get("files")) is not None else None


def held_copy(volume: Tree, node: int) -> tuple[str | None, dict]:
    """(the tag of `node`'s copy this volume keeps, its record), or (None, {}): a copy counts only whole, every file
    of its record there with its size."""
    base = f"{COPIES}/{node}"
    record = volume.read_json(f"{base}/{RECORD}", HEADER_BYTES) or {}
    tag, files = valid_tag(record.get("tag")), valid_files(record.get("files"))
    if tag is None or files is None:
        return None, {}
    for relpath, size in files.items():
        info = volume.stat(f"{base}/{tag}/{relpath}")
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None, {}
    return tag, record


def mib(size: float) -> str:
    return f"{size / 2**20:,.1f} MiB"


# ---- the keeper

class Keeper:
    """Serves this worker's keeping of its ring neighbour's part (see the module's docstring)."""

    def __init__(self, ring: Ring, volume: Tree, server: socket.socket | None = None):
        self.ring, self.volume = ring, volume
        self.server = server or listen(ring.port)
        self.slots = threading.BoundedSemaphore(CONNECTIONS)
        self.lock = threading.Lock()  # one copy received at a time
        threading.Thread(target=self.serve, name="peer-keeper", daemon=True).start()

    def close(self) -> None:
        """Stops serving (shutdown first: a close alone leaves the accept() of the serving thread listening)."""
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()

    def serve(self) -> None:
        channel.accept_each(self.server, self.handle, "peer-request", self.slots)

    def handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IO_TIMEOUT_S)
            with conn, conn.makefile("rb") as reader:
                answer = self.answer(read_line(reader), reader, conn)
                if answer is not None:
                    conn.sendall(line("ok" if answer.get("ok") else "refused", **answer))
        except OSError:
            pass
        finally:
            self.slots.release()

    def answer(self, request: dict | None, reader, conn: socket.socket) -> dict | None:
        if request is None or request.get("release") != self.ring.release:
            return {"ok": False, "why": "not a request of this release's peer copy"}
        node = protocol.count(request.get("node"), 1 << 20)
        if node != self.ring.kept:
            return {"ok": False, "why": f"worker {self.ring.node} keeps worker {self.ring.kept}'s part only"}
        kind = request.get("m")
        if kind == "holds":
            return {"ok": True, "tag": held_copy(self.volume, node)[0]}
        if kind == "put":
            return self.receive(node, request, reader, conn)
        if kind == "get":
            return self.give(node, request, conn)
        return {"ok": False, "why": "not a request of the peer copy"}

    def receive(self, node: int, request: dict, reader, conn: socket.socket) -> dict | None:
        tag, layout = valid_tag(request.get("tag")), valid_layout(request)
        if tag is None or layout is None:
            return {"ok": False, "why": "a copy is a tag name and its files' relative paths and sizes (their links "
                                        "and data regions fitting them)"}
        total, free = sum(sent.data for sent in layout.values()), self.volume.free_bytes()
        if free is None or total + ROOM_MARGIN > free:
            why = (f"{self.volume.path()} on worker {self.ring.node} has {mib(free or 0)} free; worker {node}'s part "
                   f"of {tag} is {mib(total)} and {mib(ROOM_MARGIN)} stay free for this worker's own saves")
            log.once(f"room {tag}", f"not keeping worker {node}'s part of {tag}: {why}")
            return {"ok": False, "why": why}
        base = f"{COPIES}/{node}"
        staging = f"{base}/{INCOMING}{tag}"
        with self.lock:
            if not self.volume.remove(staging):
                return {"ok": False, "why": f"{self.volume.path(staging)}: cannot be cleared ({self.volume.error})"}
            conn.sendall(line("ready"))
            started = time.monotonic()
            try:
                receive_files(reader, self.volume, staging, layout)
            except (PeerError, OSError) as err:
                self.volume.remove(staging)
                log(f"worker {node}'s copy of {tag} not kept: {err}")
                return None
            record = {"tag": tag, "step": checkpoints.step_of(tag), "node": node, **checkpoints.layout_record(layout),
                      "latest_at_root": request.get("latest_at_root") is True, "time": time.time()}
            if not (self.volume.remove(f"{base}/{tag}") and self.volume.rename(staging, f"{base}/{tag}")
                    and self.volume.write(f"{base}/{RECORD}", json.dumps(record))):
                self.volume.remove(staging)
                return {"ok": False, "why": f"{self.volume.path(base)}: the copy cannot be put in place "
                                            f"({self.volume.error})"}
            for name in self.volume.names(base):
                if name not in (tag, RECORD):
                    self.volume.remove(f"{base}/{name}")
        seconds = time.monotonic() - started
        log(f"keeping worker {node}'s part of {tag} ({len(layout)} files, {mib(total)} in {seconds:.1f}s)")
        return {"ok": True, "tag": tag}

    def give(self, node: int, request: dict, conn: socket.socket) -> dict | None:
        tag, record = held_copy(self.volume, node)
        layout = valid_layout(record) if tag is not None else None
        if tag is None or layout is None or request.get("tag") != tag:
            return {"ok": False, "why": f"worker {self.ring.node} keeps {tag or 'no copy'} of worker {node}'s part, "
                                        f"not {clean(request.get('tag'), 140)}"}
        conn.sendall(line("ok", ok=True, tag=tag, **checkpoints.layout_record(layout),
                          latest_at_root=record.get("latest_at_root") is True))
        try:
            send_files(conn, self.volume, f"{COPIES}/{node}/{tag}", layout)
        except (PeerError, OSError) as err:
            log(f"giving worker {node} its part of {tag} back failed: {err}")
        return None


# ---- a worker's requests to its keeper

def request(ring: Ring, kind: str, **fields) -> tuple[socket.socket, object]:
    sock = socket.create_connection((ring.hosts[ring.keeper], ring.port), timeout=CONNECT_S)
    sock.settimeout(IO_TIMEOUT_S)
    sock.sendall(line(kind, release=ring.release, node=ring.node, **fields))
    return sock, sock.makefile("rb")


def answer_of(ring: Ring, reader) -> dict:
    found = read_line(reader)
    if found is None:
        raise PeerError(f"worker {ring.keeper} ({ring.name(ring.keeper)}) closed the connection without an answer")
    if found.get("ok") is not True and found.get("m") != "ready":
        raise PeerError(f"worker {ring.keeper} refused: {clean(found.get('why'), 400)}")
    return found


def ask_holds(ring: Ring) -> str | None:
    sock, reader = request(ring, "holds")
    with sock, reader:
        return valid_tag(answer_of(ring, reader).get("tag"))


def send_part(ring: Ring, volume: Tree, tag: str) -> int:
    """This worker's part of `tag` to its keeper; its bytes."""
    layout = checkpoints.how_sent(volume, tag)
    if not layout:
        raise PeerError(f"{volume.path(tag)}: gone before its copy began")
    sock, reader = request(ring, "put", tag=tag, **checkpoints.layout_record(layout),
                           latest_at_root=checkpoints.latest(volume) == tag)
    with sock, reader:
        answer_of(ring, reader)  # ready
        sent = send_files(sock, volume, tag, layout)
        answer_of(ring, reader)
    return sent


def fetch(ring: Ring, volume: Tree, tag: str) -> tuple[int, bool]:
    """This worker's part of `tag` back from its keeper into its own volume (a staging directory, renamed into
    place when whole): (bytes, whether `latest` named it)."""
    sock, reader = request(ring, "get", tag=tag)
    with sock, reader:
        found = answer_of(ring, reader)
        layout = valid_layout(found)
        if layout is None or found.get("tag") != tag:
            raise PeerError(f"worker {ring.keeper} answered no list of {tag}'s files")
        staging = f"{FETCHING}{tag}"
        if not volume.mkdir() or not volume.remove(staging):
            raise PeerError(f"{volume.path(staging)}: cannot be cleared ({volume.error})")
        try:
            total = receive_files(reader, volume, staging, layout)
        except (PeerError, OSError):
            volume.remove(staging)
            raise
    if not volume.remove(tag) or not volume.rename(staging, tag):
        raise PeerError(f"{volume.path(tag)}: cannot be put in place ({volume.error})")
    volume.write(RESTORED, json.dumps({"tag": tag, "from": "peer", "worker": ring.keeper, "time": time.time()}))
    return total, found.get("latest_at_root") is True


# ---- the sender

class Replicator:
    """Sends this worker's newest complete part to its keeper (see the module's docstring); `status` is what the
    sidecar publishes (protocol.PEER_STATUS in the pod's state directory)."""

    def __init__(self, ring: Ring, volume: Tree, state: Tree | None = None):
        self.ring, self.volume, self.state = ring, volume, state
        self.lock = threading.Lock()
        self.held: str | None = None  # the tag the keeper was last known to hold
        self.checked = 0.0
        self.failures, self.next_try = 0, 0.0
        self.status: dict = {"v": protocol.VERSION, "keeper": ring.name(ring.keeper), "replicated_step": None,
                             "local_step": None, "lag_steps": None, "bytes": 0, "seconds": None, "bytes_per_s": None,
                             "failures": 0, "error": ""}
        self.published = ""

    def newest(self) -> str | None:
        local = checkpoints.complete_tags(self.volume)
        return local[0] if local else None

    def step(self, force: bool = False) -> str | None:
        """One round: the newest complete tag copied where the keeper lacks it; the tag the keeper holds."""
        with self.lock:
            now = time.monotonic()
            if now < self.next_try and not force:
                return self.held
            newest = self.newest()
            self.status["local_step"] = checkpoints.step_of(newest) if newest else None
            try:
                if newest and (newest != self.held or now - self.checked >= VERIFY_S):
                    self.held, self.checked = ask_holds(self.ring), time.monotonic()
                    if self.held != newest:
                        self.copy(newest)
                    self.status["replicated_step"] = checkpoints.step_of(self.held) if self.held else None
                if self.failures:
                    log(f"the copies reach worker {self.ring.keeper} again")
                self.failures, self.status["error"] = 0, ""
            except (OSError, PeerError) as err:
                self.failures += 1
                self.status["failures"] += 1
                error = str(err) if isinstance(err, PeerError) else f"{type(err).__name__}: {err.strerror or err}"
                if error != self.status["error"]:
                    log(f"copying to worker {self.ring.keeper} ({self.ring.name(self.ring.keeper)}) failed: {error}; "
                        "trying again with backoff (training goes on)")
                self.status["error"] = clean(error, 300)
                self.next_try = time.monotonic() + min(BACKOFF_MAX_S, 2.0 ** self.failures)
            local, copied = self.status["local_step"], self.status["replicated_step"]
            self.status["lag_steps"] = local - (copied or 0) if local is not None else None
            self.publish()
            return self.held

    def copy(self, tag: str) -> None:
        started = time.monotonic()
        sent = send_part(self.ring, self.volume, tag)
        seconds = time.monotonic() - started
        self.held = tag
        self.status.update(bytes=sent, seconds=round(seconds, 3),
                           bytes_per_s=round(sent / seconds) if seconds > 0 else None)
        log(f"{tag}: this worker's part ({mib(sent)}) is kept on worker {self.ring.keeper} "
            f"({self.ring.name(self.ring.keeper)}), copied in {seconds:.1f}s")

    def publish(self) -> None:
        text = json.dumps(self.status, separators=(",", ":"))
        if self.state is not None and text != self.published and self.state.write(protocol.PEER_STATUS, text):
            self.published = text

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            self.step()

    def flush(self, seconds: float) -> None:
        """After a stop: the newest tag (the stop's save) copied, within `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            newest = self.newest()
            if newest is None or self.step(force=True) == newest:
                return
            time.sleep(0.2)
        log(f"the stop's checkpoint did not reach worker {self.ring.keeper} within {seconds:.0f}s: the last copied "
            f"one ({self.held or 'none'}) is what a new pod of this worker resumes from")


@dataclass
class Running:
    ring: Ring
    keeper: Keeper
    replicator: Replicator
    stop: threading.Event = field(default_factory=threading.Event)

    def flush_after_stop(self, since: float, env=os.environ) -> None:
        """After a SIGTERM at `since` (time.monotonic()) and the ranks' stop: the stop's checkpoint to the keeper,
        within the pod's grace period less a margin (the chart gives the ranks DS_KILL_GRACE_SECONDS of it, and the
        pod STOP_MARGIN_S more)."""
        grace = protocol.number(env.get("DS_KILL_GRACE_SECONDS")) or 20.0
        self.replicator.flush(grace + STOP_MARGIN_S - 2.0 - (time.monotonic() - since))


def start(hosts: list[str], node: int | None = None, env=os.environ) -> Running | None:
    """The keeper and the sender of this worker (threads), where the chart turns the peer copy on."""
    ring = Ring.from_env(hosts, node, env)
    if ring is None:
        return None
    volume = volume_of(env)
    state = env.get(protocol.STATE_DIR_ENV)
    keeper = Keeper(ring, volume)
    replicator = Replicator(ring, volume, Tree(state, log) if state else None)
    running = Running(ring, keeper, replicator)
    threading.Thread(target=replicator.run, args=(running.stop,), name="peer-copy", daemon=True).start()
    log(f"worker {ring.node} keeps worker {ring.kept}'s newest checkpoint part; its own is kept on worker "
        f"{ring.keeper} ({ring.name(ring.keeper)}), port {ring.port}")
    return running


# ---- before an attempt: what each host holds, the plan, each host's preparation

def job_peer_step(env=os.environ) -> int | None:
    """The peer copy's newest copied step as the job's progress ConfigMap showed it, which the owner's sidecar notes
    (protocol.JOB_PEER_STEP), or None."""
    state = env.get(protocol.STATE_DIR_ENV)
    noted = Tree(state).read_json(protocol.JOB_PEER_STEP) if state else None
    return protocol.count(noted.get("step")) if isinstance(noted, dict) else None


def holdings(ring: Ring, volume: Tree) -> dict:
    """What this worker can resume from: its own complete tags (newest first), the copy it keeps of its
    neighbour's part, and where its newest restore came from."""
    own = checkpoints.complete_tags(volume)[:HOLDINGS_TAGS]
    restored = volume.read_json(RESTORED) or {}
    return {"node": ring.node, "own": own, "keeps": held_copy(volume, ring.kept)[0],
            "restored": {"tag": restored["tag"], "from": restored.get("from")}
            if restored.get("tag") in own and restored.get("from") in ("peer", "bucket") else None}


def valid_holdings(value, nodes: int) -> dict | None:
    """A host's holdings as another host sent them, typed, else None."""
    if not isinstance(value, dict):
        return None
    node = protocol.count(value.get("node"), nodes)
    own = value.get("own")
    if node is None or not isinstance(own, list) or len(own) > HOLDINGS_TAGS or not all(map(valid_tag, own)):
        return None
    keeps = valid_tag(value.get("keeps"))
    restored = value.get("restored") if isinstance(value.get("restored"), dict) else {}
    source = restored.get("from") if valid_tag(restored.get("tag")) and restored.get("from") in ("peer", "bucket") \
        else None
    return {"node": node, "own": own, "keeps": keeps,
            "restored": {"tag": restored["tag"], "from": source} if source else None}


@dataclass
class Plan:
    tag: str | None  # None: a fresh start
    peer: list[int]  # the workers that fetch their part from their keeper
    line: str
    resumed: str = ""  # where the parts come from: one of protocol.RESUMED_FROM (the ledger's, for `make why`)
    newer: list[str] = field(default_factory=list)  # tags some worker holds that are newer than `tag`: set aside

    def message(self) -> dict:
        return {"tag": self.tag, "peer": self.peer}

    @property
    def prepares(self) -> bool:
        """Whether any volume needs making ready (a part to fetch, a newer tag to set aside): most retries in place
        need nothing, and an ssh launcher then spares the workers a round."""
        return bool(self.tag and (self.peer or self.newer))


def plan(found: dict[int, dict], nodes: int, resumed_before: str | None = None,
         copied: int | None = None) -> Plan | str:
    """The newest tag every worker holds on its own volume or through its keeper, from every host's holdings; or
    why there is none though some worker holds a checkpoint, or though the job's volumes had one (an earlier attempt
    of this owner resumed from `resumed_before`, or the peer copy had copied step `copied`, as the progress ConfigMap
    showed: every volume lost since), in one line."""
    own = {n: set(found[n]["own"]) for n in range(nodes)}
    copy = {kept_by(n, nodes): found[n]["keeps"] for n in range(nodes)}  # worker -> the tag its keeper holds of it
    candidates = sorted(set().union(*own.values()) | {t for t in copy.values() if t}, key=checkpoints.order,
                        reverse=True)
    if not candidates and (resumed_before or copied):
        had = f"attempts of this job resumed from {resumed_before}" if resumed_before else \
            f"the peer copy had copied step {copied} (the progress ConfigMap's peerStep)"
        return (f"no worker holds a checkpoint any more, though {had}: every worker's volume was lost (their pods "
                "replaced together), and the peer copies survive the loss of one pod, not of two neighbouring ones; "
                "a checkpoints.objectStore bucket survives both; not starting from step 0 (a new install of the "
                "release starts afresh)")
    if not candidates:
        return Plan(None, [], "no worker holds a complete checkpoint: the run starts from the beginning")
    for tag in candidates:
        missing = [n for n in range(nodes) if tag not in own[n] and copy[n] != tag]
        if missing:
            continue
        peer = [n for n in range(nodes) if tag not in own[n]]
        restored = {n: found[n]["restored"]["from"] for n in range(nodes)
                    if found[n]["restored"] and found[n]["restored"]["tag"] == tag and n not in peer}
        parts = [f"worker{'s' if len(peer) > 1 else ''} {', '.join(map(str, peer))} from the copy "
                 f"{'their peers keep' if len(peer) > 1 else 'its peer keeps'} (worker "
                 f"{', '.join(str(keeper_of(n, nodes)) for n in peer)})"] if peer else []
        parts += [f"worker {n} from what it restored from the {source}" for n, source in restored.items()]
        rest = nodes - len(peer) - len(restored)
        parts += ["every worker from its own volume" if rest == nodes else
                  f"the other worker{'s' if rest > 1 else ''} from {'their' if rest > 1 else 'its'} own "
                  f"volume{'s' if rest > 1 else ''}"] if rest else []
        newer = [t for t in candidates if checkpoints.order(t) > checkpoints.order(tag)]
        line = f"resuming from {tag}: " + "; ".join(parts) + (
            f" ({', '.join(newer[:3])}{' ...' if len(newer) > 3 else ''} not held by every worker: set aside)"
            if newer else "")
        own_volumes, peer_copy, bucket = protocol.RESUMED_FROM
        resumed = peer_copy if peer else (bucket if "bucket" in restored.values() else own_volumes)
        return Plan(tag, peer, line, resumed, newer)
    newest = candidates[0]
    missing = [n for n in range(nodes) if newest not in own[n] and copy[n] != newest]
    lost = [n for n in missing if not own[n] and not copy[n]]  # nothing of theirs anywhere
    shown = lost or missing
    keepers = [keeper_of(n, nodes) for n in shown]
    plural = len(shown) > 1
    said = (f"no checkpoint is held by every worker, on its own volume or as the copy its peer keeps: worker"
            f"{'s' if plural else ''} {', '.join(map(str, shown))} ")
    if not lost:
        said += f"hold{'' if plural else 's'} no part of {newest} nor of an older tag every worker holds"
    else:
        said += f"hold{'' if plural else 's'} none, nor does the peer (worker {', '.join(map(str, keepers))})"
        if any(own[k] for k in keepers) and not any(not own[k] and k in lost for k in keepers):
            said += (": the peer's own volume is there, so the lost pod's part had not been copied yet (the "
                     "first copy lands a few seconds after the first checkpoint's commit)")
        else:
            said += ": the peer copies survive the loss of one pod, not of two neighbouring ones"
    return said + ("; a checkpoints.objectStore bucket survives both; not starting from step 0 over the other "
                   "workers' checkpoints")


def prepare(ring: Ring, volume: Tree, tag: str | None, from_peer: bool) -> str:
    """This worker's volume made ready for `tag`: its part fetched from its keeper (from_peer), the tags newer than
    it set aside, `latest` naming it where the layout has one; what was done (one line), or PeerError."""
    if tag is None:
        return ""
    done = []
    latest_at_root = checkpoints.latest(volume) == tag
    if from_peer:
        started = time.monotonic()
        total, latest_at_root = fetch(ring, volume, tag)
        seconds = time.monotonic() - started
        done.append(f"fetched its part of {tag} from worker {ring.keeper} ({mib(total)} in {seconds:.1f}s, "
                    f"{mib(total / seconds if seconds > 0 else 0)}/s)")
    newer = [name for name in volume.dirs() if valid_tag(name) and checkpoints.of_a_known_layout(name)
             and checkpoints.order(name) > checkpoints.order(tag)]
    if newer:
        volume.remove(ASIDE)
        moved = [name for name in newer if volume.rename(name, f"{ASIDE}/{name}")]
        if len(moved) != len(newer):
            raise PeerError(f"{volume.path()}: cannot set aside {', '.join(sorted(set(newer) - set(moved)))} "
                            f"({volume.error})")
        done.append(f"set aside {', '.join(sorted(moved, key=checkpoints.order))} (not held by every worker) in "
                    f"{volume.path(ASIDE)}")
    named = checkpoints.latest(volume)
    if named != tag and (latest_at_root or checkpoints.TAG_PATTERN.match(tag) or checkpoints.DEEPSPEED_PATTERN.match(
            tag) or (named is not None and not volume.is_dir(named))):
        if not volume.write(checkpoints.LATEST, tag):
            raise PeerError(f"{volume.path(checkpoints.LATEST)}: cannot be written ({volume.error})")
        done.append(f"`latest` names {tag}")
    return "; ".join(done)
