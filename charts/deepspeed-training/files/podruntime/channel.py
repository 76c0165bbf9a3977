"""The attempt loop's channel between the hosts and the ledger's owner, open for the whole job, attempts included, on
the channel port (DS_CHANNEL_PORT, deepspeed.masterPort + 1): JSON lines, each one message (`{"v":
protocol.VERSION, "m": kind, ...}`, at most LINE_BYTES), typed on arrival (decode).

nossh: worker 0 serves a Hub; every other worker's loop keeps a Spoke connected to it (and connects again when it
drops). Messages:
  spoke -> hub   join {index, evidence?, holds?}   I am here, ready for the next attempt (with my evidence of the
                                           last one when the hub may not have it: a new connection; with what my
                                           volume holds when the peer copy is on: peercopy.holdings)
                 end {index, evidence?, run?, holds?}   my run of the attempt ended: my evidence of it (a run
                                           that ended well: its run ID only; then the worker may leave)
                 stopping {index, host}    my pod got SIGTERM: the attempt is a preemption (before my ranks stop)
                 waiting {run, since, who} my watchdog found my ranks of `run` waiting in a collective since `since`
                                           (wall time of their last step) without a step: the hub tells every host
  hub -> spoke   go {env, resume?}         the attempt begins: its env for every rank (and the peer copy's plan:
                                           the tag every worker resumes from, who fetches it from its peer)
                 stop {cause, reason}      a stop rule ends the job (why, in the ledger's words)
                 halt {run, reason}        a host left run `run` (its pod got SIGTERM, or its connection dropped
                                           mid-run): stop your ranks of it now, or never start them (the ranks
                                           left would wait for it in their rendezvous or a collective: minutes)
                 waiting {run, since, who} a host's ranks wait (above): a rank here idle outside any collective is
                                           what they wait for (watchdog.py)
ssh: every worker's agent serves a Listener; the launcher keeps a Spoke connected to each (index: the worker's), and
the agent sends `stopping` over it when its pod gets SIGTERM, before its ranks stop, and `waiting` when its watchdog
finds its ranks waiting, which the launcher sends on to every agent. The ranks' own processes start and end with
each attempt; the channel does not.
"""

import json
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable

from podruntime import protocol
from podruntime.tenantfiles import parse_json
from podruntime.text import clean, complete_lines

LINE_BYTES = 192 * 1024  # a message: an evidence record (64 KiB of hang report, 64 end records) and its envelope
RETRY_S = 0.25  # a refused connection costs nothing: the spoke tries again at once
KINDS = {"join", "end", "stopping", "go", "stop", "halt", "waiting"}
Handlers = dict[str, Callable[[dict], None]]  # a message kind -> what takes it on arrival (in a thread of its own)


def encode(kind: str, **fields) -> bytes:
    return (json.dumps({"v": protocol.VERSION, "m": kind, **fields}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str) -> dict | None:
    """A message, typed: its kind known, its index a number, its evidence valid (else dropped); None if none."""
    value, why = parse_json(line, LINE_BYTES)
    if why or not isinstance(value, dict) or value.get("v") != protocol.VERSION or value.get("m") not in KINDS:
        return None
    message = {"m": value["m"], "index": protocol.count(value.get("index"), 1 << 20), "host": clean(
        value.get("host", ""), 253), "run": clean(value.get("run", ""), 64)}
    if "evidence" in value:
        message["evidence"] = protocol.valid_host_evidence(value["evidence"])
    if isinstance(value.get("env"), dict):
        message["env"] = {str(k): str(v) for k, v in value["env"].items()}
    if value.get("cause") is not None:
        message["cause"] = clean(value["cause"], 64)
    if value.get("reason") is not None:
        message["reason"] = clean(value["reason"], 1000)
    if value["m"] == "waiting":
        message["since"] = protocol.number(value.get("since")) or 0.0
        message["who"] = clean(value.get("who", ""), 300)
    for key in ("holds", "resume"):  # the peer copy's (peercopy.py types them where it reads them)
        if isinstance(value.get(key), dict):
            message[key] = value[key]
    return message


class Hub:
    """Worker 0's end: accepts the workers, reads their messages into `inbox` ((index, message); a lost
    connection is (index, {"m": "gone"})), and sends to them. A thread of its own, on the system's selector (epoll:
    thousands of workers, where select() stops at 1,024 descriptors)."""

    def __init__(self, port: int, expected: set[int], handlers: Handlers | None = None):
        self.expected, self.handlers = expected, handlers or {}
        self.inbox: queue.Queue = queue.Queue()
        self.connections: dict[int, socket.socket] = {}  # index -> its connection (any thread, under the lock)
        self.peers: dict[socket.socket, list] = {}  # connection -> [index or None, unread bytes] (the hub's thread)
        self.lock = threading.Lock()
        self.server = listen(port)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        threading.Thread(target=self.serve, name="hub", daemon=True).start()

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(0.5):
                if key.fileobj is not self.server:
                    self.receive(key.fileobj)
                    continue
                try:
                    conn, _ = self.server.accept()
                except OSError:
                    continue
                self.peers[conn] = [None, b""]
                self.selector.register(conn, selectors.EVENT_READ)

    def receive(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        peer = self.peers[sock]
        lines, rest = complete_lines(peer[1] + data)
        if not data or len(rest) > LINE_BYTES:
            self.drop(sock)
            return
        for line in lines:
            message = decode(line)
            if message is None:
                continue
            if peer[0] is None:  # the first message of a connection names the worker
                if message["m"] != "join" or message["index"] not in self.expected:
                    self.drop(sock)
                    return
                self.adopt(sock, message["index"])
            if message["m"] in self.handlers:
                handle(self.handlers[message["m"]], {**message, "index": peer[0]})
                continue
            self.inbox.put((peer[0], message))
        peer[1] = rest

    def adopt(self, sock: socket.socket, index: int) -> None:
        self.peers[sock][0] = index
        with self.lock:
            old = self.connections.get(index)
            self.connections[index] = sock
        if old is not None and old is not sock:
            self.drop(old)  # a reconnect of the same worker: its old connection says nothing more

    def drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        index = self.peers.pop(sock, [None])[0]
        with self.lock:
            if index is not None and self.connections.get(index) is sock:
                del self.connections[index]
                self.inbox.put((index, {"m": "gone", "index": index}))
        sock.close()

    def send(self, index: int, data: bytes) -> bool:
        with self.lock:
            conn = self.connections.get(index)
        if conn is None:
            return False
        try:
            conn.sendall(data)
            return True
        except OSError:
            return False  # it left just now: its reconnect, or the run's rendezvous, will tell


def handle(handler: Callable[[dict], None], message: dict) -> None:
    """`message` to its handler, in a thread of its own: the reader goes on reading."""
    threading.Thread(target=handler, args=(message,), name=message["m"], daemon=True).start()


def listen(port: int) -> socket.socket:
    """IPv4 and IPv6 where the pod has both, else IPv4 (SO_REUSEADDR: a restarted worker 0 listens again at once)."""
    try:
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError):
        return socket.create_server(("", port))


def accept_each(server: socket.socket, handle: Callable[[socket.socket], None], name: str,
                slots: threading.Semaphore | None = None) -> None:
    """Accepts connections until `server` closes, each handled in a thread of its own; with `slots`, one beyond them is
    closed at once (`handle` releases its slot)."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        if slots is not None and not slots.acquire(blocking=False):
            conn.close()
            continue
        threading.Thread(target=handle, args=(conn,), name=name, daemon=True).start()


class Spoke:
    """One connection to a host's hub or listener (nossh: a worker's to worker 0; ssh: the launcher's to each
    worker), made again when it drops; its messages in `inbox` (shared by several spokes: (index, message)), but those
    of a kind in `handlers` (a `halt`, a `waiting`) to their handler at once (the inbox may be read between runs
    only)."""

    def __init__(self, index: int, host0: str, port: int, inbox: queue.Queue | None = None,
                 handlers: Handlers | None = None):
        self.index, self.host0, self.port, self.handlers = index, host0, port, handlers or {}
        self.shared = inbox is not None
        self.inbox: queue.Queue = inbox if inbox is not None else queue.Queue()
        self.sock: socket.socket | None = None
        self.reason = "not tried yet"

    def connect(self, deadline: float, hello: bytes, stop: threading.Event | None = None) -> bool:
        """Connected (or already), with `hello` sent first; False at the deadline (or once `stop` is set), `reason`
        says why. It returns once connected, even if the connection is gone again by then: what came over it
        (a `go`, then `gone`) is in the inbox for the caller, who would otherwise wait here for a host that has
        already sent it everything and left."""
        if self.sock is not None:
            return True
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            sock = None
            try:
                sock = socket.create_connection((self.host0, self.port), timeout=2)
                sock.settimeout(None)
                sock.sendall(hello)
            except OSError as err:
                if sock is not None:
                    sock.close()  # connected, but the hello did not go: not left to the collector
                self.reason = err.strerror or str(err)
                time.sleep(RETRY_S)
                continue
            self.sock = sock
            threading.Thread(target=self.read, args=(sock,), name="spoke", daemon=True).start()
            return True
        return False

    def read(self, sock: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data or len(buffer) > LINE_BYTES:
                break
            *lines, buffer = (buffer + data).split(b"\n")
            for line in lines:
                message = decode(line)
                if message is not None and message["m"] in self.handlers:
                    handle(self.handlers[message["m"]], {**message, "index": self.index})
                elif message is not None:
                    self.put(message)
        if self.sock is sock:
            self.sock = None
            self.reason = "the other end closed the connection"
            self.put({"m": "gone"})
        sock.close()

    def put(self, message: dict) -> None:
        self.inbox.put((self.index, message) if self.shared else message)

    def send(self, data: bytes) -> bool:
        sock = self.sock
        if sock is None:
            return False
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False


class Listener:
    """An ssh worker agent's end: accepts the launcher's connections (any that says `join`) and sends to all of them;
    what they send after the join goes to `handlers` by its kind (others are dropped). A thread of its own."""

    def __init__(self, port: int, handlers: Handlers | None = None):
        self.handlers = handlers or {}
        self.server = listen(port)
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve, name="listener", daemon=True).start()

    def serve(self) -> None:
        accept_each(self.server, self.hold, "listener-peer")

    def hold(self, conn: socket.socket) -> None:
        """Keeps a connection once it said `join`, until it closes, reading its messages."""
        buffer, joined = b"", False
        try:
            while True:
                data = conn.recv(65536)
                lines, buffer = complete_lines(buffer + data)
                if not data or len(buffer) > LINE_BYTES:
                    return
                for line in lines:
                    message = decode(line)
                    if not joined:
                        if message is None or message["m"] != "join":
                            return
                        with self.lock:
                            self.connections.append(conn)
                            joined = True
                    elif message is not None and message["m"] in self.handlers:
                        handle(self.handlers[message["m"]], message)
        except OSError:
            pass
        finally:
            if joined:
                with self.lock:
                    self.connections.remove(conn)
            conn.close()

    def broadcast(self, data: bytes) -> int:
        """`data` to every connection; how many took it."""
        with self.lock:
            connections = list(self.connections)
        sent = 0
        for conn in connections:
            try:
                conn.sendall(data)
                sent += 1
            except OSError:
                pass
        return sent
