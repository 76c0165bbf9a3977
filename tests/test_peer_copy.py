"""The peer copy (podruntime/peercopy.py) between real sockets on this host, each keeper on its own loopback
address as each pod has its own: a worker's newest complete part reaches its keeper in the background, comes back
to a new pod of that worker, and the plan picks the newest tag every worker holds (own volume or peer), never a mix
and never step 0. What a keeper receives is a tenant's checkpoint: every hostile copy (a path that climbs, a link
planted where the copy goes, a lie about sizes, a cut stream, a copy that does not fit, a request of another
release or of another worker) is refused whole, each beside the legitimate case."""

import json
import os
import socket

import pytest

from podruntime import checkpoints, peercopy, protocol, sidecar
from podruntime.peercopy import Keeper, PeerError, Replicator, Ring
from podruntime.tenantfiles import Tree
from tests.support.ports import free_port

RELEASE = "ml/peer"


def write_tag(volume: Tree, step: int, files: dict[str, bytes] | None = None) -> str:
    """A train package tag on one worker's volume, complete: its files, then commit.json listing them."""
    tag = f"step_{step:08d}"
    files = files or {"mp_rank_00_model_states.pt": os.urandom(3000), "zero/rank_0.pt": os.urandom(5000)}
    for relpath, data in files.items():
        assert volume.write(f"{tag}/{relpath}", data)
    assert volume.write(f"{tag}/{checkpoints.COMMIT_FILE}", json.dumps(
        {"step": step, "files": {relpath: len(data) for relpath, data in files.items()}}))
    assert volume.write(checkpoints.LATEST, tag)
    return tag


class Workers:
    """`count` workers on 127.0.0.(i+1), one port, each with its volume under tmp_path and its keeper serving."""

    def __init__(self, tmp_path, count: int = 2):
        self.port = free_port()
        self.hosts = [f"127.0.0.{i + 1}" for i in range(count)]
        self.volumes = [Tree(tmp_path / f"worker{i}" / "checkpoints") for i in range(count)]
        self.states = [Tree(tmp_path / f"worker{i}" / "state") for i in range(count)]
        self.rings = [Ring(i, self.hosts, self.port, RELEASE) for i in range(count)]
        self.keepers = [self.keep(i) for i in range(count)]
        self.senders = [Replicator(self.rings[i], self.volumes[i], self.states[i]) for i in range(count)]

    def keep(self, i: int) -> Keeper:
        self.volumes[i].mkdir()
        return Keeper(self.rings[i], self.volumes[i], socket.create_server((self.hosts[i], self.port)))

    def new_pod(self, i: int, tmp_path) -> None:
        """Worker i's pod replaced: an empty volume (its keeper keeps serving on the same address)."""
        self.keepers[i].close()
        self.volumes[i] = Tree(tmp_path / f"worker{i}-new" / "checkpoints")
        self.keepers[i] = self.keep(i)
        self.senders[i] = Replicator(self.rings[i], self.volumes[i], self.states[i])

    def close(self):
        for keeper in self.keepers:
            keeper.close()

    def holdings(self) -> dict[int, dict]:
        return {i: peercopy.valid_holdings(json.loads(json.dumps(peercopy.holdings(self.rings[i], self.volumes[i]))),
                                           len(self.hosts)) for i in range(len(self.hosts))}


@pytest.fixture
def workers(tmp_path):
    found = Workers(tmp_path)
    yield found
    found.close()


def test_the_ring_each_worker_keeps_the_next_ones_part():
    assert [peercopy.keeper_of(n, 4) for n in range(4)] == [3, 0, 1, 2]
    assert [peercopy.kept_by(n, 4) for n in range(4)] == [1, 2, 3, 0]
    hosts = ["w-0.svc", "w-1.svc"]
    assert Ring.from_env(hosts, 1, {peercopy.PORT_ENV: "29498", "DS_RELEASE": RELEASE}).keeper == 0
    for env in ({}, {peercopy.PORT_ENV: ""}, {peercopy.PORT_ENV: "x"}, {peercopy.PORT_ENV: "70000"}):
        assert Ring.from_env(hosts, 1, env) is None  # the chart's switch off, or no valid port
    assert Ring.from_env(["w-0.svc"], 0, {peercopy.PORT_ENV: "29498"}) is None  # one worker: nothing to copy to


def test_a_part_reaches_its_keeper_and_comes_back_to_a_new_pod_of_its_worker(workers, tmp_path):
    own = {"mp_rank_00_model_states.pt": os.urandom(200_000), "zero/bf16_zero_pp_rank_1_optim_states.pt":
           os.urandom(300_000), "empty.bin": b""}
    write_tag(workers.volumes[0], 10)
    tag = write_tag(workers.volumes[1], 10, own)
    assert workers.senders[1].step() == tag
    assert peercopy.held_copy(workers.volumes[0], 1)[0] == tag  # worker 0 keeps worker 1's part
    status = json.loads((tmp_path / "worker1" / "state" / protocol.PEER_STATUS).read_text())
    assert status["replicated_step"] == 10 and status["lag_steps"] == 0 and status["bytes"] > 500_000
    assert sidecar.peer_fields(status) == {"peerStep": "10", "peerLagSteps": "0"}  # what the ConfigMap shows
    assert workers.senders[1].step() == tag  # nothing newer: nothing sent again

    workers.new_pod(1, tmp_path)  # the pod is deleted; its emptyDir goes with it
    found = workers.holdings()
    assert found[1]["own"] == [] and found[0]["keeps"] == tag
    plan = peercopy.plan(found, 2)
    assert plan.tag == tag and plan.peer == [1] and plan.resumed == "peer copy" and plan.prepares, plan
    assert "worker 1 from the copy its peer keeps (worker 0)" in plan.line
    said = peercopy.prepare(workers.rings[1], workers.volumes[1], plan.tag, True)
    assert f"fetched its part of {tag} from worker 0" in said
    for relpath, data in own.items():
        assert (workers.volumes[1].path(tag) / relpath).read_bytes() == data
    assert checkpoints.complete_tags(workers.volumes[1]) == [tag] and checkpoints.latest(workers.volumes[1]) == tag
    assert workers.holdings()[1]["restored"] == {"tag": tag, "from": "peer"}
    assert not [n for n in workers.volumes[1].names() if n.startswith(".")]  # no staging left behind


def test_a_part_of_hard_links_and_holes_is_sent_as_the_volume_holds_it_and_comes_back_the_same(workers, tmp_path):
    """A program's part with 200 hard links of its shard and a 1 GiB file of two data blocks: the copy sends the
    shard once and the blocks only (not 1.2 GiB), the keeper holds what the sender's volume holds, and a new pod gets
    the links and the holes back."""
    shard = os.urandom(1 << 20)
    tag = write_tag(workers.volumes[1], 10, {"shard.pt": shard})
    base = workers.volumes[1].path(tag)
    (base / "links").mkdir()
    for i in range(200):
        os.link(base / "shard.pt", base / "links" / f"{i}.pt")
    with open(base / "sparse.bin", "wb") as f:
        f.write(b"head")
        f.seek(1 << 30)
        f.write(b"tail")
    assert workers.senders[1].step() == tag
    status = json.loads((tmp_path / "worker1" / "state" / protocol.PEER_STATUS).read_text())
    assert (1 << 20) < status["bytes"] < (2 << 20), status  # the shard once, two blocks, commit.json
    kept = workers.volumes[0].path(f"{peercopy.COPIES}/1/{tag}")
    assert (kept / "links" / "7.pt").stat().st_ino == (kept / "shard.pt").stat().st_ino
    assert (kept / "sparse.bin").stat().st_blocks * 512 < 1 << 20
    workers.new_pod(1, tmp_path)
    said = peercopy.prepare(workers.rings[1], workers.volumes[1], tag, True)
    assert f"fetched its part of {tag} from worker 0" in said
    back = workers.volumes[1].path(tag)
    assert (back / "shard.pt").read_bytes() == shard and (back / "shard.pt").stat().st_nlink == 201
    assert (back / "sparse.bin").stat().st_size == (1 << 30) + 4 and (back / "sparse.bin").stat().st_blocks < 2048
    with open(back / "sparse.bin", "rb") as f:
        assert (f.read(4), f.seek(1 << 30), f.read(4)) == (b"head", 1 << 30, b"tail")


def test_a_newer_save_replaces_the_copy_and_a_keeper_that_lost_it_gets_it_again(workers, tmp_path):
    write_tag(workers.volumes[1], 10)
    workers.senders[1].step()
    newer = write_tag(workers.volumes[1], 20)
    assert workers.senders[1].step() == newer
    assert workers.volumes[0].names(f"{peercopy.COPIES}/1") == [peercopy.RECORD, newer]  # one copy kept
    workers.new_pod(0, tmp_path)  # the keeper's pod is replaced: the copy is gone with its volume
    workers.senders[1].checked = 0.0  # its next check (every VERIFY_S) finds it gone
    assert workers.senders[1].step() == newer and peercopy.held_copy(workers.volumes[0], 1)[0] == newer


def test_the_plan_takes_the_newest_tag_every_worker_holds_and_sets_newer_ones_aside(tmp_path):
    workers = Workers(tmp_path, 3)
    try:
        for i in range(3):
            write_tag(workers.volumes[i], 10)
            workers.senders[i].step()
        for i in range(3):
            write_tag(workers.volumes[i], 20)  # worker 1's part of step 20 is lost with its pod below
        every = peercopy.plan(workers.holdings(), 3)
        assert every.line == "resuming from step_00000020: every worker from its own volume" and not every.peer
        workers.new_pod(1, tmp_path)
        plan = peercopy.plan(workers.holdings(), 3)
        assert plan.tag == "step_00000010" and plan.peer == [1]
        assert plan.line.startswith("resuming from step_00000010: worker 1 from the copy its peer keeps (worker 0); "
                                    "the other workers from their own volumes"), plan.line
        assert "step_00000020 not held by every worker: set aside" in plan.line and plan.prepares
        said = peercopy.prepare(workers.rings[0], workers.volumes[0], plan.tag, False)
        assert "set aside step_00000020" in said and "`latest` names step_00000010" in said
        assert checkpoints.complete_tags(workers.volumes[0]) == ["step_00000010"]
        assert workers.volumes[0].is_dir(f"{peercopy.ASIDE}/step_00000020")  # kept, not deleted
    finally:
        workers.close()


def test_two_neighbours_lost_stop_in_one_line_and_a_fresh_job_starts_from_the_beginning(tmp_path):
    nothing = {n: {"node": n, "own": [], "keeps": None, "restored": None} for n in range(3)}
    assert peercopy.plan(nothing, 3).tag is None  # a fresh job: nobody holds anything
    # Every volume lost after an attempt resumed from a checkpoint (two workers, both pods replaced): the owner
    # remembers, and the job stops rather than train from step 0.
    gone = peercopy.plan(nothing, 3, resumed_before="step_00000040")
    assert isinstance(gone, str) and "resumed from step_00000040" in gone and "not starting from step 0" in gone
    # The same with a new owner (nossh: worker 0's pod was one of them), which knows the peer copy's step from the
    # progress ConfigMap (the sidecar notes it: tests/test_sidecar.py).
    gone = peercopy.plan(nothing, 3, copied=60)
    assert isinstance(gone, str) and "the peer copy had copied step 60 (the progress ConfigMap's peerStep)" in gone \
        and "not starting from step 0 (a new install of the release starts afresh)" in gone, gone
    found = {0: {"node": 0, "own": ["step_00000010"], "keeps": None, "restored": None},  # worker 0 keeps worker 1's
             1: {"node": 1, "own": [], "keeps": None, "restored": None},  # worker 1 keeps worker 2's
             2: {"node": 2, "own": [], "keeps": None, "restored": None}}  # workers 1 and 2 are new pods
    why = peercopy.plan(found, 3)
    assert isinstance(why, str) and "\n" not in why
    assert "not starting from step 0" in why
    assert "workers 1, 2 hold none, nor does the peer (worker 0, 1): the peer copies survive the loss of one pod, " \
        "not of two neighbouring ones" in why
    # One pod lost before its first copy landed: its peer is there, and says it kept nothing yet.
    first = {0: {"node": 0, "own": ["step_00000010"], "keeps": None, "restored": None},
             1: {"node": 1, "own": [], "keeps": None, "restored": None}}
    why = peercopy.plan(first, 2)
    assert "worker 1 holds none, nor does the peer (worker 0): the peer's own volume is there, so the lost pod's " \
        "part had not been copied yet" in why, why
    # The bucket restored worker 1 and 2's pods: the tag they restored is the plan's, said so.
    restored = {"tag": "step_00000010", "from": "bucket"}
    found[1] |= {"own": ["step_00000010"], "restored": restored}
    found[2] |= {"own": ["step_00000010"], "restored": restored}
    plan = peercopy.plan(found, 3)
    assert plan.tag == "step_00000010" and plan.peer == [] and plan.resumed == "bucket"
    assert not plan.prepares  # every volume holds it, none a newer one: nothing to make ready
    assert "worker 1 from what it restored from the bucket" in plan.line


def test_a_trainer_checkpoint_newer_on_one_worker_is_set_aside_so_no_worker_resumes_ahead(tmp_path):
    """get_last_checkpoint() takes the newest checkpoint-N directory: one left on worker 0 that worker 1 lacks would
    resume the two workers at different steps."""
    volumes = [Tree(tmp_path / f"w{i}") for i in range(2)]
    for volume, steps in zip(volumes, ((5, 10), (5,)), strict=True):
        for step in steps:
            volume.write(f"checkpoint-{step}/{checkpoints.TRAINER_STATE}", "{}")
    ring = Ring(0, ["127.0.0.1", "127.0.0.2"], free_port(), RELEASE)
    found = {i: peercopy.holdings(Ring(i, ring.hosts, ring.port, RELEASE), volumes[i]) for i in range(2)}
    plan = peercopy.plan(found, 2)
    assert plan.tag == "checkpoint-5" and plan.peer == []
    peercopy.prepare(ring, volumes[0], plan.tag, False)
    assert volumes[0].dirs() == ["_job", "checkpoint-5"] and not volumes[0].is_file(checkpoints.LATEST)


def request(workers, header: dict, body: bytes = b"") -> dict:
    """One raw request to worker 0's keeper, as any pod of the release could send it; its answer."""
    with socket.create_connection((workers.hosts[0], workers.port), timeout=10) as sock:
        sock.sendall((json.dumps({"v": protocol.VERSION, "release": RELEASE, **header}) + "\n").encode())
        reader = sock.makefile("rb")
        first = peercopy.read_line(reader) or {}
        if first.get("m") == "ready":
            sock.sendall(body)
            sock.shutdown(socket.SHUT_WR)
            return peercopy.read_line(reader) or {"m": "closed"}
        return first


def test_hostile_copies_are_refused_whole_and_the_copy_held_before_stays(workers, tmp_path):
    held = write_tag(workers.volumes[1], 10)
    workers.senders[1].step()
    outside = tmp_path / "outside"
    for bad in ({"node": 1, "m": "put", "tag": "step_00000020", "files": {"../../outside/x": 3}},
                {"node": 1, "m": "put", "tag": "step_00000020", "files": {"/etc/x": 3}},
                {"node": 1, "m": "put", "tag": "step_00000020", "files": {"a": -1}},
                {"node": 1, "m": "put", "tag": "..", "files": {"a": 3}},
                {"node": 1, "m": "put", "tag": "step_00000020", "files": {"a": True}},
                {"node": 0, "m": "put", "tag": "step_00000020", "files": {"a": 3}},  # not the worker it keeps
                {"node": 1, "m": "put", "tag": "step_00000020", "files": {"a": 1 << 60}},  # does not fit
                {"node": 1, "m": "get", "tag": "step_00000020"},  # not the copy it holds
                {"node": 1, "m": "delete"}):
        answer = request(workers, bad, b"abc")
        assert answer.get("ok") is False and answer.get("why"), (bad, answer)
    other = request(workers, {"node": 1, "m": "holds", "release": "other/release"})
    assert other.get("ok") is False  # another release's pod (without the NetworkPolicy, say)
    # A cut stream: fewer bytes than the header says.
    assert request(workers, {"node": 1, "m": "put", "tag": "step_00000020", "files": {"a": 10}}, b"abc") == \
        {"m": "closed"}
    assert peercopy.held_copy(workers.volumes[0], 1)[0] == held  # the copy held before is still whole
    assert not outside.exists()
    # A link planted where a copy goes (the tenant's ranks write this volume) is not written through.
    base = workers.volumes[0].path(peercopy.COPIES) / "1"
    target = tmp_path / "victim"
    target.mkdir()
    (base / f"{peercopy.INCOMING}step_00000030").symlink_to(target)
    answer = request(workers, {"node": 1, "m": "put", "tag": "step_00000030", "files": {"a": 3}}, b"abc")
    assert list(target.iterdir()) == []
    assert answer.get("ok") is True or answer == {"m": "closed"}  # the link was removed, not followed
    # The legitimate copy beside them.
    assert request(workers, {"node": 1, "m": "put", "tag": "step_00000040", "files": {"a/b": 3}}, b"xyz")["ok"]
    assert peercopy.held_copy(workers.volumes[0], 1)[0] == "step_00000040"


def test_a_copy_record_that_lies_or_a_file_gone_from_the_copy_is_no_copy(workers):
    tag = write_tag(workers.volumes[1], 10)
    workers.senders[1].step()
    base = workers.volumes[0].path(peercopy.COPIES) / "1"
    assert peercopy.held_copy(workers.volumes[0], 1)[0] == tag
    (base / tag / "zero" / "rank_0.pt").write_bytes(b"short")  # a file of the copy changed
    assert peercopy.held_copy(workers.volumes[0], 1) == (None, {})
    for record in (b"[" * 5000, b'{"tag": "../x", "files": {}}', b'{"tag": "step_1", "files": {"../a": 1}}'):
        (base / peercopy.RECORD).write_bytes(record)
        assert peercopy.held_copy(workers.volumes[0], 1) == (None, {})
    for holdings in ({"node": 5, "own": []}, {"node": 0, "own": [".."]}, {"node": 0, "own": "step_1"},
                     {"node": 0, "own": ["x"] * 100}, [], None):
        assert peercopy.valid_holdings(holdings, 2) is None


def test_a_sender_whose_keeper_is_away_retries_with_backoff_and_says_so_once(tmp_path, capsys):
    ring = Ring(1, ["127.0.0.1", "127.0.0.2"], free_port(), RELEASE)  # no keeper listens there
    volume = Tree(tmp_path / "w1")
    write_tag(volume, 10)
    sender = Replicator(ring, volume, Tree(tmp_path / "state"))
    assert sender.step() is None and sender.step() is None  # the second waits out its backoff
    assert sender.status["failures"] == 1 and sender.status["lag_steps"] == 10
    assert capsys.readouterr().out.count("copying to worker 0") == 1
    with pytest.raises((PeerError, OSError)):
        peercopy.fetch(ring, volume, "step_00000010")
