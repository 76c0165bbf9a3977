"""The one set of rules for what a tenant's program writes (podruntime/tenantfiles.py), each with the hostile input
that breaks it and the legitimate case beside: no link followed anywhere on a path, regular files only, nothing that
blocks, every read bounded in size and JSON depth, nothing raises (a refused record is nothing, and why is said
once), every write beneath its root through a fresh name; and every record the pod programs read, planted with a
JSON bomb, a link and a FIFO."""

import json
import os
import threading
import time

import pytest

from podruntime import channel, checkpoints, evidence, ledger, protocol, sidecar
from podruntime.tenantfiles import MAX_DEPTH, Tree, parse_json
from podruntime.text import Log

BOMB = b"[" * 5000  # json's own parser recurses: RecursionError, which a reader must never raise
DEEP = json.dumps({"a": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))})


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "token"
    path.write_text("the reader's own token")
    return path


def test_a_record_is_read_and_a_link_a_fifo_a_device_a_directory_or_a_huge_file_is_not(tmp_path, secret):
    tree = Tree(tmp_path / "ranks")
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "good.json").write_text('{"step": 7}')
    assert tree.read_json("good.json") == {"step": 7}  # the legitimate case
    (tmp_path / "ranks" / "link.json").symlink_to(secret)
    (tmp_path / "ranks" / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "ranks" / "fifo.json")
    (tmp_path / "ranks" / "dir.json").mkdir()
    (tmp_path / "ranks" / "huge.json").write_bytes(b"{" + b" " * (1 << 20) + b"}")
    started = time.monotonic()
    for name in ("link.json", "zero", "fifo.json", "dir.json", "huge.json", "../token", "", ".", "a/../../token"):
        assert tree.read_json(name) is None, name
    assert tree.read("zero") is None and tree.read("fifo.json") is None  # never blocks on the FIFO
    assert len(tree.read("huge.json", 100)) == 100  # bounded
    assert time.monotonic() - started < 2


def test_a_link_anywhere_on_the_path_is_refused_also_the_roots_own(tmp_path, secret):
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "sub" / "f.json").write_text('{"x": 1}')
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "hop").symlink_to(tmp_path / "real" / "sub")
    assert Tree(tmp_path / "real").read_json("sub/f.json") == {"x": 1}
    assert Tree(tmp_path / "real").read_json("hop/f.json") is None  # a link inside
    assert Tree(tmp_path / "linked").read_json("sub/f.json") is None  # the root replaced by a link
    assert Tree(tmp_path / "linked").names() == [] and not Tree(tmp_path / "linked").is_dir()
    # A program's own directory (the train package reading its checkpoints) may be reached through a link.
    assert Tree(tmp_path / "linked", trusted_root=True).read_json("sub/f.json") == {"x": 1}


def test_a_json_bomb_or_a_deep_document_is_refused_without_raising_and_said_once(tmp_path, capsys):
    state = tmp_path / "ranks"
    state.mkdir()
    (state / "bomb.json").write_bytes(BOMB)
    (state / "deep.json").write_text(DEEP)
    (state / "fine.json").write_text(json.dumps({"a": json.loads("[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2))}))
    tree = Tree(state, Log("reader"))
    for _ in range(3):
        assert tree.read_json("bomb.json") is None and tree.read_json("deep.json") is None
    assert tree.read_json("fine.json") is not None
    said = capsys.readouterr().out.splitlines()
    assert len([line for line in said if "bomb.json" in line]) == 1, said  # why, once
    assert len([line for line in said if "deep.json" in line]) == 1, said
    assert parse_json(BOMB)[0] is None and parse_json(b'{"a": 1}') == ({"a": 1}, "")


def test_a_write_replaces_a_planted_link_and_never_writes_through_one(tmp_path, secret):
    root = tmp_path / "ckpt"
    root.mkdir()
    tree = Tree(root)
    (root / "latest").symlink_to(secret)
    (root / ".latest.tmp").symlink_to(secret)  # the name a restore once wrote through
    assert tree.write("latest", "step_00000010")
    assert secret.read_text() == "the reader's own token" and (root / "latest").read_text() == "step_00000010"
    (root / "_job").symlink_to(tmp_path)  # a parent planted as a link: nothing lands outside
    assert not tree.write("_job/attempts/0001/outcome", "0")
    assert not (tmp_path / "attempts").exists()
    assert tree.write("fresh/dir/file", b"bytes") and (root / "fresh" / "dir" / "file").read_bytes() == b"bytes"
    assert not tree.write("fresh/dir/file", "again", exclusive=True)
    (root / "planted").symlink_to(secret)
    assert tree.create("planted") is None and tree.create("fresh/dir/file") is None  # streaming: new files only
    with tree.create("fresh/new") as out:
        out.write(b"streamed")
    assert (root / "fresh" / "new").read_bytes() == b"streamed"


def test_removal_and_listing_follow_no_link(tmp_path, secret):
    root = tmp_path / "ckpt"
    (root / "tag" / "sub").mkdir(parents=True)
    (root / "tag" / "sub" / "shard.pt").write_bytes(b"w" * 10)
    (root / "tag" / "token").symlink_to(secret)
    (root / "tag" / "outside").symlink_to(tmp_path)
    os.mkfifo(root / "tag" / "fifo")
    tree = Tree(root)
    assert {k: v.st_size for k, v in tree.files("tag").items()} == {"sub/shard.pt": 10}
    assert tree.open_stream("tag/fifo") is None and tree.open_stream("tag/token") is None
    with tree.open_stream("tag/sub/shard.pt") as stream:
        assert stream.read() == b"w" * 10
    assert tree.remove("tag") and not (root / "tag").exists()
    assert secret.exists() and (tmp_path / "ckpt").exists()  # what the links pointed at is intact
    (root / "alink").symlink_to(tmp_path / "ckpt")
    assert tree.remove("alink") and (tmp_path / "ckpt").is_dir()


def test_a_fifo_is_poked_only_when_it_is_one_and_read(tmp_path):
    tree = Tree(tmp_path)
    (tmp_path / "plain.diag").write_text("")
    assert not tree.poke_fifo("plain.diag", b"s") and (tmp_path / "plain.diag").read_text() == ""
    os.mkfifo(tmp_path / "1.diag")
    assert not tree.poke_fifo("1.diag", b"s")  # no reader: nothing waits on it
    got = []
    reader = threading.Thread(target=lambda: got.append((tmp_path / "1.diag").read_bytes()))
    reader.start()
    deadline = time.monotonic() + 10
    while not tree.poke_fifo("1.diag", b"s") and time.monotonic() < deadline:
        time.sleep(0.05)
    reader.join(timeout=10)
    assert got == [b"s"]


# ---------------------------------------------------------------- every record a pod program reads

def plant(path, kind: str, secret) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "bomb":
        path.write_bytes(BOMB)
    elif kind == "deep":
        path.write_text(DEEP)
    elif kind == "link":
        path.symlink_to(secret)
    else:
        os.mkfifo(path)


RUN = "run-0001-job1"


def readers(tmp_path):
    """(the record's path, what reads it, what the reader gives for a record it refuses), for every record."""
    state, attempts, ckpt = tmp_path / "ranks", tmp_path / "attempts", tmp_path / "ckpt"
    env = {protocol.STATE_DIR_ENV: str(state), "DS_ATTEMPTS_DIR": str(attempts), "DS_JOB_UID": "job1"}
    book = ledger.Ledger(env, Log("attempts"))
    pod = sidecar.Pod(Tree(state), 2, 1)
    return [
        (state / protocol.PROGRESS, lambda: pod.record(protocol.PROGRESS), None),
        (state / protocol.VERDICT, lambda: pod.record(protocol.VERDICT), None),
        (state / "end-0.json", lambda: evidence.of_run(RUN, 1, env)["ends"], []),
        (state / f"hang-{RUN}.json", lambda: evidence.of_run(RUN, 1, env)["hang"], None),
        (state / protocol.STOP_NOTICE, lambda: evidence.of_run(RUN, 1, env)["stopped"], False),
        (state / protocol.JOB_ID_FILE, lambda: ledger.job_id(env), "job1"),
        (attempts / "job1" / "budget.json", book.budget_record, {}),
        (attempts / "job1" / "0001" / "cause.json", lambda: book.cause_of(1), {}),
        (attempts / "job1" / "0001" / "outcome", lambda: book.verdict(1), "failure"),
        (ckpt / "step_00000010" / "commit.json", lambda: checkpoints.complete_tags(Tree(ckpt)), []),
        (ckpt / "latest", lambda: checkpoints.complete_tags(Tree(ckpt)), []),
        # The Trainer's marker: its presence (a regular file) completes the tag; it is never parsed.
        (ckpt / "checkpoint-20" / "trainer_state.json", lambda: checkpoints.complete_tags(Tree(ckpt)), []),
    ]


@pytest.mark.parametrize("kind", ["bomb", "deep", "link", "fifo"])
def test_every_record_a_pod_program_reads_survives_a_hostile_one(tmp_path, secret, kind):
    for index in range(len(readers(tmp_path))):
        case = tmp_path / f"{kind}-{index}"
        case.mkdir()
        path, read, refused = readers(case)[index]
        if path.name == "outcome":
            (path.parent).mkdir(parents=True)
        if path.parent.name.startswith(("step_", "checkpoint-")) or path.name == "latest":
            (path.parent if path.name != "latest" else path.parent / "global_step9").mkdir(parents=True)
        plant(path, kind, secret)
        started = time.monotonic()
        if path.name == "trainer_state.json" and kind in ("bomb", "deep"):
            refused = ["checkpoint-20"]  # there, and regular: the tag is complete; nothing reads its text
        assert read() == refused, (kind, path.name)
        assert time.monotonic() - started < 2, (kind, path.name)


def test_every_record_a_pod_program_reads_is_read_when_it_is_legitimate(tmp_path):
    state, ckpt = tmp_path / "ranks", tmp_path / "ckpt"
    state.mkdir()
    env = {protocol.STATE_DIR_ENV: str(state), "DS_ATTEMPTS_DIR": str(tmp_path / "attempts"), "DS_JOB_UID": "job1"}
    (state / protocol.PROGRESS).write_text(json.dumps({"run": RUN, "step": 9}))
    (state / "end-0.json").write_text(json.dumps(protocol.end_record(RUN, 0, "w", "program-error", "boom", 9, 1.0)))
    (state / protocol.STOP_NOTICE).write_text(json.dumps({"run": RUN}))
    (state / protocol.JOB_ID_FILE).write_text("cm-uid\n")
    found = evidence.of_run(RUN, 1, env)
    assert (found["step"], len(found["ends"]), found["stopped"]) == (9, 1, True)
    assert ledger.job_id(env) == "cm-uid"
    (ckpt / "step_00000010").mkdir(parents=True)
    (ckpt / "step_00000010" / "shard.pt").write_bytes(b"w")
    (ckpt / "step_00000010" / "commit.json").write_text(json.dumps({"files": {"shard.pt": 1}}))
    (ckpt / "checkpoint-20").mkdir()
    (ckpt / "checkpoint-20" / "trainer_state.json").write_text("{}")
    (ckpt / "global_step30").mkdir()
    (ckpt / "latest").write_text("global_step30")
    assert checkpoints.complete_tags(Tree(ckpt)) == ["global_step30", "checkpoint-20", "step_00000010"]


def test_tags_are_ordered_by_the_step_their_name_ends_with_in_every_layout():
    names = ["step950", "step1000", "global_step99", "checkpoint-1001", "step_00000100", "final", "epoch3-step10"]
    assert sorted(names, key=checkpoints.order, reverse=True) == [
        "checkpoint-1001", "step1000", "step950", "step_00000100", "global_step99", "final", "epoch3-step10"]
    assert [checkpoints.step_of(n) for n in ("step950", "final", "epoch3-step10", "200")] == [950, None, None, None]
    assert [checkpoints.of_a_known_layout(n) for n in ("step_00000100", "checkpoint-3", "global_step3", "run2")] == [
        True, True, True, False]


# ---------------------------------------------------------------- checkpoint tags: one positive grammar

@pytest.mark.parametrize("latest", ["..", ".", "../etc", "a/b", "x\x1b[2J", "", "global_step30\n\nextra"])
def test_latest_names_a_tag_only_in_the_tag_grammar(tmp_path, latest):
    (tmp_path / "global_step30").mkdir()
    (tmp_path / "latest").write_text(latest)
    assert checkpoints.complete_tags(Tree(tmp_path)) == []
    (tmp_path / "latest").write_text("global_step30\n")  # the legitimate one beside it
    assert checkpoints.complete_tags(Tree(tmp_path)) == ["global_step30"]


def test_a_tag_outside_the_grammar_is_skipped_and_said_once_never_an_error(tmp_path, capsys):
    for name in ("epoch=3-step=10", "x\x1b]52;c;aGk=\x07", "checkpoint-20"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text("{}")
    tree = Tree(tmp_path, Log("objectstore"))
    for _ in range(3):
        assert checkpoints.complete_tags(tree) == ["checkpoint-20"]
    said = capsys.readouterr().out
    assert said.count("epoch=3-step=10") == 1 and "\x1b" not in said and "\x07" not in said, said


# ---------------------------------------------------------------- what crosses between hosts

@pytest.mark.parametrize("line", [BOMB, DEEP.encode(), b'{"v": 99, "m": "go"}', b"\xff\xfe", b'{"v": 2, "m": "rm"}',
                                  json.dumps({"v": 2, "m": "end", "evidence": {"v": 2, "kind": "evidence",
                                                                              "ends": "x" * 10}}).encode()])
def test_a_channel_message_is_typed_on_arrival(line):
    message = channel.decode(line)
    assert message is None or message.get("evidence") is None or (
        message["evidence"]["ends"] == [] and protocol.valid_host_evidence(message["evidence"]) == message["evidence"])
    legit = channel.decode(channel.encode("go", env={"DS_ATTEMPT": "2"}))
    assert legit["m"] == "go" and legit["env"] == {"DS_ATTEMPT": "2"}


@pytest.mark.parametrize("fields", [{"since": "yesterday", "who": "r\x1b[2J" * 500}, {"since": [1], "who": {"a": 1}},
                                    {"since": float("inf"), "who": None}, {}])
def test_a_watchdogs_word_that_ranks_wait_is_typed_on_arrival(fields):
    """`waiting` (watchdog.py) crosses hosts through the ledger's owner: its time a number (0: none, the oldest, which
    no rank's last step follows closely enough to count), its `who` one bounded line."""
    message = channel.decode(channel.encode("waiting", run="run-0001-a", **fields))
    assert message["m"] == "waiting" and message["run"] == "run-0001-a"
    assert isinstance(message["since"], float) and message["since"] in (0.0, float("inf")) or fields == {}
    assert isinstance(message["who"], str) and len(message["who"]) <= 300 and "\x1b" not in message["who"]
    legit = channel.decode(channel.encode("waiting", run="run-0001-a", since=1000.5, who="rank 1 on w-1"))
    assert (legit["since"], legit["who"]) == (1000.5, "rank 1 on w-1")


def test_a_copy_sends_each_inode_once_and_a_files_data_regions_at_most_max_regions_of_them(tmp_path, secret):
    """What a copy of a tag sends (checkpoints.how_sent): hard links by name, holes left out, a file of thousands of
    data regions merged over its smallest holes; a link to a file outside the tag is neither followed nor sent."""
    tag = tmp_path / "ckpt" / "step_00000001"
    tag.mkdir(parents=True)
    (tag / "a.pt").write_bytes(b"x" * 5000)
    os.link(tag / "a.pt", tag / "b.pt")
    (tag / "out").symlink_to(secret)
    block = os.statvfs(tag).f_bsize
    with open(tag / "holes.bin", "wb") as f:
        for i in range(3000):  # data in every other block: 3,000 regions
            f.seek(2 * i * block)
            f.write(b"d")
        f.truncate(6000 * block)
    sent = checkpoints.how_sent(Tree(tmp_path / "ckpt"), "step_00000001")
    assert set(sent) == {"a.pt", "b.pt", "holes.bin"}
    assert (sent["a.pt"].data, sent["b.pt"].link, sent["b.pt"].data) == (5000, "a.pt", 0)
    regions = sent["holes.bin"].regions
    assert regions is not None and len(regions) == checkpoints.MAX_REGIONS, len(regions or ())
    assert regions[0][0] == 0 and sum(regions[-1]) == 5999 * block  # every data block covered, none past the last
    # 3,000 data blocks and the 1,976 one-block holes merged away (2,999 holes, 1,023 kept), of 6,000 blocks
    assert sent["holes.bin"].data == (3000 + 2999 - (checkpoints.MAX_REGIONS - 1)) * block
    files = {name: s.size for name, s in sent.items()}
    manifest = {"files": files, "links": {"b.pt": "a.pt"}, "regions": {"holes.bin": [list(r) for r in regions]}}
    assert checkpoints.layout_record(sent) == manifest and checkpoints.layout_of(manifest) == sent
    for hostile in ({"links": {"b.pt": "../a.pt"}}, {"links": {"b.pt": "b.pt"}}, {"links": {"c.pt": "a.pt"}},
                    {"links": {"b.pt": "a.pt", "a.pt": "holes.bin"}}, {"regions": {"a.pt": [[0, 5001]]}},
                    {"regions": {"a.pt": [[10, 5], [12, 1]]}}, {"regions": {"a.pt": [[0, 0]]}},
                    {"regions": {"a.pt": [[0, True]]}}, {"regions": {"b.pt": [[0, 1]]}, "links": {"b.pt": "a.pt"}},
                    {"regions": {"a.pt": [[i, 1] for i in range(checkpoints.MAX_REGIONS + 1)]}}, {"links": []}):
        assert checkpoints.layout_of({"files": files, **hostile}) is None, hostile
    assert checkpoints.layout_of({"files": {"a.pt": "5000"}}) is None
