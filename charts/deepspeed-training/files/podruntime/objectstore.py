"""The release's checkpoints in an S3-compatible bucket (chart value checkpoints.objectStore): uploaded in the
background from every worker's volume (a thread of the progress sidecar), restored before the ranks start where no
volume holds them (the restore init container). It runs in the platform's image (the sidecar's: python3 with the
`minio` client), never the tenant's, and only its containers hold the bucket's credentials.

In the bucket, under the release's prefix `<namespace>/<release>/` (DS_RELEASE, fixed by the chart):

    checkpoints/<tag>/parts/<node>/<path>   the files a worker's volume holds of the tag (its part): each inode once,
                                            a file with holes as its data regions one after the other
    checkpoints/<tag>/parts/<node>.json     that part's manifest, put after its files: {files: {path: size}, links:
                                            {path: the first path of its inode}, regions: {path: [[offset, length]]}}
    checkpoints/<tag>/committed.json        put last, once the manifests of every node of this world size (and
                                            no other) are there: by node 0's uploader, or by a restore
    job/attempts/..., job/goodput/...       the job's records (the failure budget's ledger, goodput): a mirror of
                                            DS_ATTEMPTS_DIR and of <checkpoints>/_job/goodput

A tag without committed.json is never restored. Which local checkpoints are complete is checkpoints.py's rule, and
every read of the volume and every write of a restore goes through tenantfiles.Tree (a tenant's program writes
these directories: no link followed, regular files only, tag names in checkpoints.TAG_NAME's grammar, paths checked
component by component). On per-worker volumes (DS_CHECKPOINT_STORAGE per-worker) every worker uploads and restores
its own part; on a shared claim node 0 alone does, with the whole tag as one part.

What a part sends is what the volume holds (checkpoints.how_sent): a hard link is recorded, not sent again; a file's
holes (SEEK_HOLE) are left out and made again by the restore; a part whose data is over DS_OBJECT_STORE_MAX_PART_BYTES
(checkpoints.objectStore.maxPartGiB) is not uploaded and its tag never committed, in one line: a tenant's program
chooses these files, and tenants share the bucket. Files are streamed in parts (multipart, parallel), each checked
again for its size after it was sent. One upload at a time, the newest complete tag: a newer one supersedes any older
one not yet started. Node 0 keeps the newest `keep` committed tags in the bucket and deletes older tags, committed or
not, never one newer than the newest committed (it may still be uploading).

Environment: DS_OBJECT_STORE_{ENDPOINT,BUCKET,REGION,PATH_STYLE,CA_FILE,KEEP,MAX_PART_BYTES,CREDENTIALS_SECRET},
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, DS_RELEASE, DS_CHECKPOINT_DIR, DS_CHECKPOINT_STORAGE, DS_NODE_RANK,
DS_WORKERS, DS_OBJECT_STORE_ROLE (worker, or launcher: the ledger only), DS_ATTEMPTS_DIR and DS_LEDGER_ON_WORKER0
(nossh: node 0's worker keeps the ledger), DS_WORKER_GRACE_SECONDS (how long a restore waits for the parts a pod
being stopped may still upload: newest_committed).
"""

import io
import json
import os
import sys
import threading
import time
import urllib.parse

from podruntime import checkpoints, ownership, protocol
from podruntime.ledger import attempts_tree, job_tree
from podruntime.tenantfiles import Tree, parse_json, parts_of
from podruntime.text import Log, error_line

PART_SIZE = 16 << 20  # multipart part size (S3's minimum is 5 MiB)
PARALLEL = 4  # parts in flight per file
MISSING = ("NoSuchKey", "NoSuchObject", "ResourceNotFound")  # the codes of an object that is not there
POLL_S = 2.0
BACKOFF_MAX_S = 60.0
CHUNK = 1 << 20
RESTORING = ".restoring-"  # a download in progress: renamed into place when whole
RECORD_BYTES, RECORDS_BYTES, RECORDS_FILES = 1 << 20, 64 << 20, 10_000  # the job's records mirrored, per kind
GRACE_ENV = "DS_WORKER_GRACE_SECONDS"  # how long a worker pod being stopped may still upload (its grace period)

log = Log("objectstore", stream=sys.stderr)  # the uploads' lines, and why a check or a restore failed
said = Log("objectstore")  # what a check or a restore did


class TagChanged(Exception):
    """A tag that changed while it was uploading (files gone, resized): its part is not recorded."""


class StoreError(Exception):
    """The bucket cannot be used as configured: one line naming the chart value."""


class Settings:
    def __init__(self, env=os.environ):
        self.endpoint = env.get("DS_OBJECT_STORE_ENDPOINT", "")
        self.bucket = env.get("DS_OBJECT_STORE_BUCKET", "")
        self.region = env.get("DS_OBJECT_STORE_REGION", "") or "us-east-1"
        self.path_style = env.get("DS_OBJECT_STORE_PATH_STYLE", "true") == "true"
        self.ca_file = env.get("DS_OBJECT_STORE_CA_FILE", "")
        self.keep = max(1, int(env.get("DS_OBJECT_STORE_KEEP", "3") or 3))
        self.max_part_bytes = max(1, int(env.get("DS_OBJECT_STORE_MAX_PART_BYTES", "") or 512 << 30))
        self.secret = env.get("DS_OBJECT_STORE_CREDENTIALS_SECRET", "")
        self.prefix = env.get("DS_RELEASE", "").strip("/") + "/"
        self.owner, self.adopt = env.get(ownership.OWNER_ENV, ""), env.get(ownership.ADOPT_ENV, "")
        self.checkpoint_dir = Tree(env.get("DS_CHECKPOINT_DIR", "/checkpoints"), log)
        self.per_worker = env.get(checkpoints.STORAGE_ENV, checkpoints.SHARED) == checkpoints.PER_WORKER
        self.node = int(env.get("DS_NODE_RANK", "0") or 0)
        self.nodes = int(env.get("DS_WORKERS", "1") or 1) if self.per_worker else 1
        # A worker pod's container keeps checkpoints; the launcher's (ssh) only the ledger, which it owns.
        self.worker = env.get("DS_OBJECT_STORE_ROLE", "worker") == "worker"
        owns_ledger = env.get("DS_OBJECT_STORE_ROLE") == "launcher" or (self.worker and self.node == 0 and
                                                                         env.get("DS_LEDGER_ON_WORKER0") == "true")
        self.attempts = attempts_tree(env, log) if owns_ledger and env.get("DS_ATTEMPTS_DIR") else None
        self.grace = max(0.0, protocol.number(env.get(GRACE_ENV)) or 0.0)
        self.access_key = env.get("AWS_ACCESS_KEY_ID", "")
        self.secret_key = env.get("AWS_SECRET_ACCESS_KEY", "")

    def uploads_checkpoints(self) -> bool:
        """Every worker on per-worker volumes; node 0 alone on a shared claim."""
        return self.worker and (self.per_worker or self.node == 0)

    def commits(self) -> bool:
        """Node 0's worker commits tags in the bucket and keeps them pruned; it also keeps rank 0's goodput."""
        return self.worker and self.node == 0

    def goodput(self) -> Tree | None:
        return job_tree(self.checkpoint_dir, protocol.GOODPUT) if self.commits() else None


class Regions:
    """A file's data regions one after the other: the object the bucket keeps of a file with holes."""

    def __init__(self, stream, regions: tuple[tuple[int, int], ...]):
        self.stream, self.regions, self.index, self.left = stream, list(regions), 0, 0

    def read(self, size: int = -1) -> bytes:
        chunks, wanted = [], size if size >= 0 else float("inf")
        while wanted > 0 and (self.left or self.index < len(self.regions)):
            if not self.left:
                offset, self.left = self.regions[self.index]
                self.index += 1
                self.stream.seek(offset)
            chunk = self.stream.read(int(min(wanted, self.left, CHUNK)))
            if not chunk:
                raise TagChanged("a file shrank while it was uploading")
            chunks.append(chunk)
            self.left -= len(chunk)
            wanted -= len(chunk)
        return b"".join(chunks)


def client(settings: Settings):
    import urllib3  # noqa: PLC0415 - the platform's image has minio and its urllib3
    from minio import Minio  # noqa: PLC0415

    url = urllib.parse.urlsplit(settings.endpoint if "://" in settings.endpoint else f"https://{settings.endpoint}")
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=5, read=60), cert_reqs="CERT_REQUIRED",
        ca_certs=settings.ca_file or None, retries=urllib3.Retry(total=3, backoff_factor=0.5,
                                                                  status_forcelist=(500, 502, 503, 504)))
    store = Minio(url.netloc, access_key=settings.access_key, secret_key=settings.secret_key,
                  secure=url.scheme == "https", region=settings.region, http_client=http)
    if settings.path_style:
        store.disable_virtual_style_endpoint()
    return store


def check(store, settings: Settings) -> None:
    """The bucket answers a listing of the release's prefix with these credentials, or StoreError naming why."""
    from minio.error import S3Error  # noqa: PLC0415

    where = "checkpoints.objectStore"
    try:
        next(iter(store.list_objects(settings.bucket, prefix=settings.prefix)), None)
    except S3Error as err:
        if err.code == "NoSuchBucket":
            raise StoreError(f"{where}.bucket {settings.bucket!r}: no such bucket at {settings.endpoint}") from None
        if err.code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise StoreError(f"{where}.credentialsSecret {settings.secret!r}: the bucket {settings.bucket!r} refuses "
                             f"these keys ({err.code}) for {settings.prefix}") from None
        raise StoreError(f"{where}: {settings.endpoint} answered {err.code}: {err.message}") from None
    except Exception as err:  # noqa: BLE001 - an unreachable endpoint, a TLS failure: one line, not a traceback
        raise StoreError(f"{where}.endpoint {settings.endpoint!r}: unreachable ({error_line(err)})") from None


class Uploader:
    """One pod's uploads; step() does one round (the sidecar calls it every POLL_S), status is what it reports."""

    def __init__(self, settings: Settings, store=None):
        self.settings = settings
        self.store = store or client(settings)
        self.uploaded: str | None = None  # the newest tag this pod's part was put for
        self.records: dict[str, tuple[int, int]] = {}  # job record key -> (size, mtime_ns) last put
        self.mirrored: dict[str, set[str]] = {}  # kind -> the record keys the bucket holds after the last pruning
        self.refused = ""  # why the newest tag was not uploaded (over the limit), until a newer one is
        self.failures = 0
        self.next_try = 0.0
        self.status: dict = {"uploaded_step": None, "local_step": None, "committed_step": None, "lag_steps": None,
                             "bytes": 0, "seconds": None, "bytes_per_s": None, "failures": 0, "error": ""}

    def key(self, *parts: str) -> str:
        return self.settings.prefix + "/".join(parts)

    def step(self) -> None:
        if time.monotonic() < self.next_try:
            return
        try:
            if self.settings.uploads_checkpoints():
                self.upload_newest()
            if self.settings.commits():
                self.commit_and_prune()
            self.upload_records()
            self.failures, self.status["error"] = 0, self.refused
        except Exception as err:  # noqa: BLE001 - the store being away never stops training: retry with backoff
            self.failures += 1
            self.status["failures"] += 1
            self.status["error"] = error_line(err)
            delay = min(BACKOFF_MAX_S, 2.0 ** self.failures)
            self.next_try = time.monotonic() + delay
            log(f"upload failed ({self.status['error']}); trying again in {delay:.0f}s")
        self.update_lag()

    def update_lag(self) -> None:
        local = checkpoints.complete_tags(self.settings.checkpoint_dir)
        self.status["local_step"] = checkpoints.step_of(local[0]) if local else None
        reference = self.status["committed_step"] if self.settings.commits() else self.status["uploaded_step"]
        if self.status["local_step"] is not None:
            self.status["lag_steps"] = self.status["local_step"] - (reference or 0)

    def upload_newest(self) -> None:
        try:
            self.upload_tag()
        except TagChanged as err:
            log(f"{err}: not committed; the newest complete tag goes up next")

    def upload_tag(self) -> None:
        local = checkpoints.complete_tags(self.settings.checkpoint_dir)
        if not local or local[0] == self.uploaded:
            return
        tag = local[0]
        manifest_key = self.key("checkpoints", tag, "parts", f"{self.settings.node}.json")
        if self.exists(manifest_key):  # put before this sidecar started (a restart, a restore from the bucket)
            self.uploaded = tag
            self.status["uploaded_step"] = checkpoints.step_of(tag)
            return
        started = time.monotonic()
        layout = checkpoints.how_sent(self.settings.checkpoint_dir, tag)
        if not layout and not self.settings.checkpoint_dir.is_dir(tag):
            raise TagChanged(f"{tag}: gone before its upload began")
        data = sum(sent.data for sent in layout.values())
        if data > self.settings.max_part_bytes:
            self.refuse(tag, data)
            return
        for relpath, sent in layout.items():
            if sent.link is None:
                self.upload_file(tag, relpath, sent)
        manifest = {"tag": tag, "step": checkpoints.step_of(tag), "node": self.settings.node,
                    "nodes": self.settings.nodes, **checkpoints.layout_record(layout),
                    "latest_at_root": checkpoints.latest(self.settings.checkpoint_dir) == tag}
        self.put_json(manifest_key, manifest)
        seconds, sent = time.monotonic() - started, data
        self.uploaded, self.refused = tag, ""
        self.status.update(uploaded_step=checkpoints.step_of(tag), bytes=sent, seconds=round(seconds, 3),
                           bytes_per_s=round(sent / seconds) if seconds > 0 else None)
        log(f"uploaded {tag} (node {self.settings.node}'s part: {len(layout)} files, {sent / 1e6:.1f} MB in "
            f"{seconds:.1f}s)")

    def refuse(self, tag: str, data: int) -> None:
        """A part over the limit is not uploaded (nor is its tag committed); said once per tag."""
        self.uploaded = tag
        self.refused = (f"{tag} not uploaded: node {self.settings.node}'s part holds {data / 2**30:.1f} GiB of data "
                        f"(each file once, holes left out), over checkpoints.objectStore.maxPartGiB "
                        f"({self.settings.max_part_bytes / 2**30:g}); the bucket keeps its older committed tags")
        log(self.refused)

    def upload_file(self, tag: str, relpath: str, sent: "checkpoints.Sent") -> None:
        """One file of the tag, streamed (its data regions only, where it has holes); its size checked before and
        after. A file that is gone, no longer regular, or of another size means the tag changed under the upload
        (a rotation deleted it, a retry rewrote it): that tag is never committed."""
        stream = self.settings.checkpoint_dir.open_stream(f"{tag}/{relpath}")
        if stream is None:
            raise TagChanged(f"{tag}: {relpath} went away while it was uploading")
        with stream:
            size = os.fstat(stream.fileno()).st_size
            if size != sent.size:
                raise TagChanged(f"{tag}: {relpath} changed size while it was uploading ({sent.size} -> {size} bytes)")
            body = Regions(stream, sent.regions) if sent.regions is not None else stream
            self.store.put_object(self.settings.bucket, self.key("checkpoints", tag, "parts", str(self.settings.node),
                                                                  relpath),
                                  body, length=sent.data, part_size=PART_SIZE, num_parallel_uploads=PARALLEL)
            if os.fstat(stream.fileno()).st_size != size:
                raise TagChanged(f"{tag}: {relpath} changed size while it was uploading")

    def exists(self, key: str) -> bool:
        from minio.error import S3Error  # noqa: PLC0415

        try:
            self.store.stat_object(self.settings.bucket, key)
            return True
        except S3Error as err:
            if err.code in MISSING:
                return False
            raise

    def read(self, key: str, limit: int) -> bytes | None:
        """At most limit + 1 bytes of an object (more than `limit`: too large), None where there is none."""
        from minio.error import S3Error  # noqa: PLC0415

        try:
            response = self.store.get_object(self.settings.bucket, key)
        except S3Error as err:
            if err.code in MISSING:
                return None
            raise
        try:
            return response.read(limit + 1)
        finally:
            response.close()
            response.release_conn()

    def put_json(self, key: str, value: dict) -> None:
        data = json.dumps(value, indent=1).encode()
        self.store.put_object(self.settings.bucket, key, io.BytesIO(data), length=len(data),
                              content_type="application/json")

    def get_json(self, key: str) -> dict:
        """A record of the bucket's (written by some pod's uploader: bounded, typed): {} if it is none."""
        response = self.store.get_object(self.settings.bucket, key)
        try:
            value, _ = parse_json(response.read(checkpoints.MAX_COMMIT_BYTES + 1), checkpoints.MAX_COMMIT_BYTES)
        finally:
            response.close()
            response.release_conn()
        return value if isinstance(value, dict) else {}

    def bucket_tags(self) -> dict[str, dict]:
        """Every tag under the release's checkpoints/ (names in the tag grammar only): {tag: {"parts": set of
        nodes, "committed": bool}}."""
        found: dict[str, dict] = {}
        for item in self.store.list_objects(self.settings.bucket, prefix=self.key("checkpoints") + "/",
                                            recursive=True):
            rest = item.object_name[len(self.key("checkpoints")) + 1:].split("/")
            if not checkpoints.is_tag_name(rest[0]):
                continue
            entry = found.setdefault(rest[0], {"parts": set(), "committed": False})
            if rest[1:] == ["committed.json"]:
                entry["committed"] = True
            elif len(rest) == 3 and rest[1] == "parts" and rest[2].endswith(".json"):
                entry["parts"].add(rest[2].removesuffix(".json"))
        return found

    def commit_whole(self, found: dict[str, dict]) -> list[str]:
        """Every tag of `found` whose every node's part is there committed (node 0's uploader does it as the parts
        arrive; a restore too, since a pod being stopped may put the last part after node 0's uploader ended: the
        record is the same whoever puts it); the committed tags, newest first."""
        for tag, entry in found.items():  # a tag of another world size (other node numbers) is not this job's to commit
            if not entry["committed"] and entry["parts"] == self.nodes():
                self.put_json(self.key("checkpoints", tag, "committed.json"), {
                    "tag": tag, "step": checkpoints.step_of(tag), "nodes": self.settings.nodes,
                    "storage": checkpoints.PER_WORKER if self.settings.per_worker else checkpoints.SHARED,
                    "time": time.time()})
                entry["committed"] = True
                log(f"committed {tag} in the bucket ({self.settings.nodes} part(s))")
        return sorted((t for t, e in found.items() if e["committed"]), key=checkpoints.order, reverse=True)

    def nodes(self) -> set[str]:
        """The part names of a tag this world size writes."""
        return {str(n) for n in range(self.settings.nodes)}

    def commit_and_prune(self) -> None:
        found = self.bucket_tags()
        committed = self.commit_whole(found)
        self.status["committed_step"] = checkpoints.step_of(committed[0]) if committed else None
        if not committed:
            return
        newest = checkpoints.order(committed[0])
        doomed = [t for t in found if (found[t]["committed"] and t not in committed[:self.settings.keep])
                  or (not found[t]["committed"] and checkpoints.order(t) < newest)]
        for tag in doomed:
            self.delete_prefix(self.key("checkpoints", tag) + "/")
            log(f"removed {tag} from the bucket (keeping the newest {self.settings.keep} committed)")

    def delete_prefix(self, prefix: str) -> None:
        from minio.deleteobjects import DeleteObject  # noqa: PLC0415

        names = [DeleteObject(o.object_name) for o in self.store.list_objects(self.settings.bucket, prefix=prefix,
                                                                              recursive=True)]
        for error in self.store.remove_objects(self.settings.bucket, names):
            log(f"could not remove {error.name}: {error.message}")

    def upload_records(self) -> None:
        """The job's records this pod keeps, mirrored on change: the ledger (its owner's), goodput (node 0's). A
        mirror, pruned as the volume is (each kind has one writer); bounded: the goodput records lie on a volume the
        tenant's program writes."""
        for kind, local in self.record_trees():
            kept, total = set(), 0
            for relpath, info in local.files(limit=RECORDS_FILES).items():
                key = self.key("job", kind, relpath)
                total += info.st_size
                if info.st_size > RECORD_BYTES or total > RECORDS_BYTES:
                    log.once(f"records {key}", f"{local.path(relpath)}: not mirrored to the bucket (a record is at "
                                               f"most {RECORD_BYTES >> 20} MiB, the job's {kind} records together "
                                               f"{RECORDS_BYTES >> 20} MiB)")
                    continue
                kept.add(key)
                if self.records.get(key) == (info.st_size, info.st_mtime_ns):
                    continue
                stream = local.open_stream(relpath)
                if stream is None:
                    continue
                with stream:
                    self.store.put_object(self.settings.bucket, key, stream,
                                          length=os.fstat(stream.fileno()).st_size)
                self.records[key] = (info.st_size, info.st_mtime_ns)
            # Something was added or went: the bucket's copy pruned to match (never to nothing: an empty or unreadable
            # tree is a fault to outlive, not a state to mirror).
            if kept and kept != self.mirrored.get(kind):
                for item in self.store.list_objects(self.settings.bucket, prefix=self.key("job", kind) + "/",
                                                    recursive=True):
                    if item.object_name not in kept:
                        self.store.remove_object(self.settings.bucket, item.object_name)
                        self.records.pop(item.object_name, None)
                self.mirrored[kind] = kept

    def record_trees(self) -> list[tuple[str, Tree]]:
        trees = [(protocol.ATTEMPTS, self.settings.attempts), (protocol.GOODPUT, self.settings.goodput())]
        return [(kind, tree) for kind, tree in trees if tree is not None and tree.is_dir()]

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()
            stop.wait(POLL_S)


def download(store, settings: Settings, prefix: str, target: Tree, under: str,
             layout: dict[str, "checkpoints.Sent"] | None = None) -> int:
    """Every object under `prefix` into target/under (each relative path checked component by component: nothing
    lands outside it, nothing is written through a link); bytes. An object of a file with holes (its `layout`'s
    regions) is written back at its regions' offsets."""
    total = 0
    for item in store.list_objects(settings.bucket, prefix=prefix, recursive=True):
        relpath = item.object_name[len(prefix):]
        if not parts_of(relpath):
            raise StoreError(f"object {item.object_name!r}: not a path below {prefix}")
        out = target.create(f"{under}/{relpath}")
        if out is None:
            raise StoreError(f"{target.path(under)}/{relpath}: cannot be written (a file or link already there?)")
        response = store.get_object(settings.bucket, item.object_name)
        try:
            with out:
                sent = (layout or {}).get(relpath)
                if sent is not None and sent.regions is not None:
                    total += write_regions(out, response.stream(CHUNK), sent.regions, sent.size, item.object_name)
                else:
                    for chunk in response.stream(CHUNK):
                        out.write(chunk)
                        total += len(chunk)
                out.flush()
                os.fsync(out.fileno())
        finally:
            response.close()
            response.release_conn()
    return total


def write_regions(out, chunks, regions: tuple[tuple[int, int], ...], size: int, name: str) -> int:
    """The object of a file with holes written back at its data regions' offsets, the file then as long as it was;
    its bytes. An object longer or shorter than its regions is refused."""
    pending, left, total = list(regions), 0, 0
    for chunk in chunks:
        total += len(chunk)
        while chunk:
            if not left:
                if not pending:
                    raise StoreError(f"object {name!r}: longer than its manifest's data regions")
                offset, left = pending.pop(0)
                out.seek(offset)
            piece = chunk[:left]
            out.write(piece)
            chunk, left = chunk[len(piece):], left - len(piece)
    if left or pending:
        raise StoreError(f"object {name!r}: shorter than its manifest's data regions")
    out.truncate(size)
    return total


def restore_parts(store, settings: Settings, uploader: Uploader, tag: str, nodes: int,
                  staging: str) -> tuple[int, bool]:
    """The tag's parts this pod keeps into `staging` (a shared claim: every part, node 0's last, whose files win where
    parts share a name: the model states every worker wrote; per-worker volumes: its own): (bytes, whether its
    writer had `latest` at the root)."""
    volume = settings.checkpoint_dir
    total, latest_at_root, manifests = 0, False, []
    for node in [settings.node] if settings.per_worker else sorted(range(nodes), reverse=True):
        part = uploader.get_json(uploader.key("checkpoints", tag, "parts", f"{node}.json"))
        latest_at_root = latest_at_root or part.get("latest_at_root") is True
        layout = checkpoints.layout_of(part) if isinstance(part.get("files"), dict) else {}
        if layout is None:
            raise StoreError(f"{tag}: node {node}'s manifest in the bucket lists links or data regions that do not fit "
                             "its files: not restored")
        part_dir = f"{staging}.{node}"
        volume.remove(part_dir)
        total += download(store, settings, uploader.key("checkpoints", tag, "parts", str(node)) + "/", volume,
                          part_dir, layout)
        for relpath, sent in layout.items():  # each inode was sent once: its other names linked to it again
            if sent.link is not None and not volume.link(f"{part_dir}/{sent.link}", f"{part_dir}/{relpath}"):
                raise StoreError(f"{volume.path(part_dir)}/{relpath}: cannot be linked to {sent.link}")
        manifest = volume.read_json(f"{part_dir}/{checkpoints.COMMIT_FILE}", checkpoints.MAX_COMMIT_BYTES)
        if manifest and isinstance(manifest.get("files"), dict):
            manifests.append(manifest)
        for relpath in volume.files(part_dir):
            if not volume.rename(f"{part_dir}/{relpath}", f"{staging}/{relpath}"):
                raise StoreError(f"{volume.path(staging)}/{relpath}: cannot be written")
        volume.remove(part_dir)
    if len(manifests) > 1:  # the train package's parts, committed one per volume: one commit for the whole tag
        volume.write(f"{staging}/{checkpoints.COMMIT_FILE}", json.dumps(checkpoints.merge_commits(manifests), indent=1))
    return total, latest_at_root


def newest_committed(uploader: Uploader, settings: Settings, local: str | None) -> list[str]:
    """The bucket's committed tags, newest first, once no tag newer than them (and than this volume's newest, `local`)
    may still be completed by a pod being stopped: one that holds this node's part and lacks another's. The workers'
    restores must choose the same tag (the ranks resume from the newest tag every worker holds), and a pod replaced
    together with the others starts only once its predecessor ended (the StatefulSet's pods, the Indexed Job's with
    podReplacementPolicy Failed), which uploaded its part of the stop's checkpoint first: a tag that lacks this node's
    part is never completed, and one that holds it may be, by the others' predecessors, within their grace period
    (DS_WORKER_GRACE_SECONDS). A restore that chose the newest committed tag at once could choose an older tag than
    the next worker's, and then no tag is held by every worker. Not covered: pods stopped one after another more
    than a grace period apart, and a pod gone from the API while its sidecar still uploads (a lost node's): a late
    part then completes a tag after an earlier restore gave up on it."""
    started = time.monotonic()
    deadline = started + (settings.grace if settings.per_worker else 0.0)
    waiting = ""
    while True:
        try:
            found = uploader.bucket_tags()
            committed = uploader.commit_whole(found)
        except Exception as err:  # noqa: BLE001 - the store away for a moment: asked again until the deadline
            if time.monotonic() >= deadline:
                raise StoreError(f"{settings.bucket}: the release's checkpoints cannot be listed "
                                 f"({error_line(err)})") from None
            time.sleep(POLL_S)
            continue
        floor = max((checkpoints.order(t) for t in [*committed[:1], *([local] if local else [])]), default=None)
        pending = sorted((t for t, e in found.items() if not e["committed"] and str(settings.node) in e["parts"]
                          and e["parts"] <= uploader.nodes() and (floor is None or checkpoints.order(t) > floor)),
                         key=checkpoints.order, reverse=True)
        if waiting and (not pending or pending[0] != waiting):
            said(f"{waiting}: {'every part is in the bucket' if waiting in committed else 'superseded'} after "
                 f"{time.monotonic() - started:.0f}s")
        if not pending:
            return committed
        if time.monotonic() >= deadline:
            if waiting:
                said(f"{pending[0]}: still lacks node(s) {missing_parts(found[pending[0]], uploader)}'s part after "
                     f"{time.monotonic() - started:.0f}s (the pods being stopped had that long): restoring the "
                     "newest committed tag")
            return committed
        if pending[0] != waiting:
            waiting = pending[0]
            said(f"{waiting} holds node {settings.node}'s part and lacks node(s) "
                 f"{missing_parts(found[waiting], uploader)}'s: waiting up to {deadline - time.monotonic():.0f}s "
                 "for a pod being stopped to upload it")
        time.sleep(POLL_S)


def missing_parts(entry: dict, uploader: Uploader) -> str:
    return ", ".join(sorted(uploader.nodes() - entry["parts"], key=int))


def restore_checkpoint(store, settings: Settings) -> str:
    """The newest committed tag where this volume holds none as new (what this pod keeps of it); what was done."""
    if not settings.uploads_checkpoints():
        return "a shared claim: node 0 restores"
    uploader = Uploader(settings, store)
    volume = settings.checkpoint_dir
    local = checkpoints.complete_tags(volume)
    committed = newest_committed(uploader, settings, local[0] if local else None)
    if not committed:
        return "no committed checkpoint in the bucket"
    tag = committed[0]
    if local and checkpoints.order(local[0]) >= checkpoints.order(tag):
        return f"{volume.path(local[0])} is as new as the bucket's newest ({tag}): nothing to restore"
    nodes = protocol.count(uploader.get_json(uploader.key("checkpoints", tag, "committed.json")).get("nodes"), 10**6)
    nodes = nodes or 1
    if settings.node >= nodes and settings.per_worker:
        return f"{tag} was written by {nodes} workers: no part for node {settings.node}"
    started, staging = time.monotonic(), f"{RESTORING}{tag}"
    if not volume.mkdir() or not volume.remove(staging):
        raise StoreError(f"{volume.path()}: cannot be written")
    total, latest_at_root = restore_parts(store, settings, uploader, tag, nodes, staging)
    if not volume.remove(tag) or not volume.rename(staging, tag):  # an incomplete local copy of it goes
        raise StoreError(f"{volume.path(tag)}: cannot be put in place")
    if (latest_at_root or checkpoints.TAG_PATTERN.match(tag)) and not volume.write(checkpoints.LATEST, tag):
        raise StoreError(f"{volume.path(checkpoints.LATEST)}: cannot be written")
    # Where this volume's tag came from, for the peer copy's plan (and `make why`: resumed from the bucket).
    volume.write(f"{protocol.JOB_DIR}/{protocol.RESTORED}", json.dumps({"tag": tag, "from": "bucket",
                                                                        "time": time.time()}))
    which = f"node {settings.node}'s part" if settings.per_worker else f"{nodes} part(s)"
    return (f"restored {tag} from the bucket into {volume.path(tag)} ({which}, {total / 1e6:.1f} MB in "
            f"{time.monotonic() - started:.1f}s)")


def claim_prefix(store, settings: Settings) -> str | None:
    """The release's prefix claimed for the project (ownership.py: its record at the prefix), or what was done;
    StoreError with the refusal when it holds another identity's data."""
    if not settings.owner:
        return None
    uploader = Uploader(settings, store)
    key = settings.prefix + ownership.RECORD
    from minio.error import S3Error  # noqa: PLC0415

    try:
        data = uploader.read(key, ownership.RECORD_BYTES)
    except S3Error as err:
        raise StoreError(f"{settings.bucket}/{key}: {err.code}") from None
    found = ownership.UNREADABLE if data is not None and len(data) > ownership.RECORD_BYTES else \
        ownership.recorded_owner(data)
    write, refusal = ownership.decide(found, settings.owner, settings.adopt, f"s3://{settings.bucket}/{settings.prefix}")
    if refusal:
        raise StoreError(refusal)
    if write:
        uploader.put_json(key, {"owner": settings.owner})
        return f"s3://{settings.bucket}/{key}: the prefix is project {settings.owner}'s" + (
            f" (adopted from {found})" if found else "")
    return None


def restore_records(store, settings: Settings) -> list[str]:
    """The job's records this pod keeps, where it has none yet (a new pod, a new volume): the failure budget and the
    goodput history survive the loss of every pod and volume."""
    done = []
    for kind, local in ((protocol.ATTEMPTS, settings.attempts), (protocol.GOODPUT, settings.goodput())):
        if local is None or local.names():
            continue
        prefix = settings.prefix + f"job/{kind}/"
        if next(iter(store.list_objects(settings.bucket, prefix=prefix)), None) is None:
            continue
        parent, name = Tree(local.root.parent, log), local.root.name
        staging = f"{RESTORING}{name}"
        if not parent.mkdir() or not parent.remove(staging):
            raise StoreError(f"{parent.path()}: cannot be written")
        count = download(store, settings, prefix, parent, staging)
        if not parent.remove(name) or not parent.rename(staging, name):
            raise StoreError(f"{local.path()}: cannot be put in place")
        done.append(f"the job's {kind} records ({count} bytes)")
    return done


def main(argv: list[str]) -> int:
    """`check`: the bucket answers with these credentials (exit 0), else one line naming the value (exit 1).
    `restore`: the check, then the newest committed tag where this volume holds none as new, and the job's records
    where the pod keeps them."""
    if not argv or argv[0] not in ("check", "restore"):
        print(main.__doc__, file=sys.stderr)
        return 2
    settings = Settings()
    try:
        store = client(settings)
        check(store, settings)
        if argv[0] == "check":
            said(f"{settings.bucket} at {settings.endpoint} answers for {settings.prefix}")
            return 0
        claimed = claim_prefix(store, settings)
        if claimed:
            said(claimed)
        said(restore_checkpoint(store, settings))
        for what in restore_records(store, settings):
            said(f"restored {what}")
    except StoreError as err:
        log(str(err))
        return 1
    return 0
