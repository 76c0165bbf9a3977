"""The object store of checkpoints (podruntime/objectstore.py) against a real S3-compatible gateway (Ceph's RADOS
Gateway, tests/support/s3.py), with checkpoints the real DeepSpeed engine wrote on two workers' own volumes: parts
uploaded and committed once every worker's is there, every pod and volume lost and the job resumed from the bucket
with the same losses and its failure budget, a tag cut by a kill during its upload never restored, retention, what a
tenant plants in a checkpoint directory or where the restore writes, and a wrong bucket, key or endpoint refused in
one line before any rank starts."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from podruntime import checkpoints, objectstore, protocol
from podruntime.ledger import Ledger
from podruntime.tenantfiles import Tree
from podruntime.text import Log
from tests.support import s3
from tests.support.chart import pod_program
from tests.support.harness import wait_for
from tests.support.ports import free_port
from tests.support.train_run import TINY, metrics, run_per_worker
from train import checkpoint

pytestmark = pytest.mark.skipif(s3.unavailable() is not None, reason=s3.unavailable() or "")


@pytest.fixture(scope="module")
def gateway():
    return s3.up()


def settings(env: dict, **extra) -> "objectstore.Settings":
    return objectstore.Settings(env={**env, **extra})


def test_every_workers_part_then_the_commit_and_a_job_that_lost_every_volume_resumes_from_the_bucket(
        gateway, trained_on_worker_volumes, tmp_path):
    ds_config, reference = trained_on_worker_volumes
    bucket = s3.new_bucket(gateway)
    dirs = [tmp_path / "worker-0", tmp_path / "worker-1"]
    common = ["--ds-config", str(ds_config), "--checkpoint-every", "4", *TINY]
    first = run_per_worker([*common, "--steps", "8"], dirs)
    assert first.returncode == 0, first.stdout[-4000:]
    ledger = tmp_path / "ledger"
    (ledger / "job-a" / "0001").mkdir(parents=True)
    (ledger / "job-a" / "0001" / "outcome").write_text("1\n")  # a failed attempt: the budget used so far
    node0 = objectstore.Uploader(settings(s3.worker_env(gateway, bucket, dirs[0], 0, DS_ATTEMPTS_DIR=str(ledger),
                                                     DS_LEDGER_ON_WORKER0="true")))
    node1 = objectstore.Uploader(settings(s3.worker_env(gateway, bucket, dirs[1], 1)))
    node0.step()  # node 0's part: no commit while node 1's is missing
    assert node0.bucket_tags()["step_00000008"] == {"parts": {"0"}, "committed": False}
    node1.step()
    node0.step()
    assert node0.bucket_tags()["step_00000008"] == {"parts": {"0", "1"}, "committed": True}
    assert node0.status["committed_step"] == 8 and node0.status["lag_steps"] == 0
    assert node1.status["uploaded_step"] == 8 and node1.status["bytes_per_s"] > 0
    # Every pod and volume lost: new, empty volumes restore their own parts (and node 0 the ledger), then resume.
    fresh = [tmp_path / "new-0", tmp_path / "new-1"]
    new_ledger = tmp_path / "new-ledger"
    for node, directory in enumerate(fresh):
        extra = {"DS_ATTEMPTS_DIR": str(new_ledger), "DS_LEDGER_ON_WORKER0": "true"} if node == 0 else {}
        restored = s3.run_objectstore("restore", s3.worker_env(gateway, bucket, directory, node, **extra))
        assert restored.returncode == 0, restored.stderr
        assert f"restored step_00000008 from the bucket into {directory / 'step_00000008'} (node {node}'s part" \
            in restored.stdout, restored.stdout
        assert checkpoint.is_complete(directory / "step_00000008")
        assert (directory / "latest").read_text() == "step_00000008"
    assert (new_ledger / "job-a" / "0001" / "outcome").read_text() == "1\n"
    assert "the job's attempts records" in s3.run_objectstore("restore", s3.worker_env(
        gateway, bucket, tmp_path / "new-0b", 0, DS_ATTEMPTS_DIR=str(tmp_path / "ledger-b"),
        DS_LEDGER_ON_WORKER0="true")).stdout
    # A volume that holds the tag already is left alone.
    again = s3.run_objectstore("restore", s3.worker_env(gateway, bucket, fresh[1], 1))
    assert "is as new as the bucket's newest (step_00000008): nothing to restore" in again.stdout, again.stdout
    resumed = run_per_worker([*common, "--steps", "16"], fresh)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"resumed from {fresh[0] / 'step_00000008'} at step 8" in resumed.stdout
    losses, expected = dict(metrics(fresh[0])["losses"]), dict(metrics(reference[0])["losses"])
    assert sorted(losses) == list(range(9, 17))
    for step in range(9, 17):
        assert losses[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


def test_ssh_a_new_launcher_pod_restores_the_ledger_and_the_job_goes_on_with_the_budget_it_had(gateway, tmp_path):
    """launchMode ssh without a shared claim: the ledger lives in the launcher pod's /tmp, and its sidecar (role
    launcher) uploads it. One attempt failed, the next was stopped by the pod's deletion (a preemption); the new
    launcher pod's restore puts the ledger back (and no checkpoint: the launcher keeps none), and its next attempt
    counts on from there."""
    bucket = s3.new_bucket(gateway)

    def attempts(pod: Path) -> Ledger:
        (pod / "ranks").mkdir(parents=True, exist_ok=True)
        return Ledger({protocol.STATE_DIR_ENV: str(pod / "ranks"), "DS_RUN_RETRIES": "2",
                       "DS_ATTEMPTS_DIR": str(pod / "attempts"), "DS_JOB_UID": "abcdef12"}, Log("attempts"))

    def launcher_env(pod: Path) -> dict:
        return s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(pod / "checkpoints"),
                            DS_OBJECT_STORE_ROLE="launcher", DS_ATTEMPTS_DIR=str(pod / "attempts"))

    old, new = tmp_path / "launcher-old", tmp_path / "launcher-new"
    attempts(old).end(attempts(old).begin().number, 1, [])
    attempts(old).mark_stopped(attempts(old).begin().number, "launcher")  # the pod deleted mid-attempt
    objectstore.Uploader(settings(launcher_env(old))).step()
    restored = s3.run_objectstore("restore", launcher_env(new))
    assert restored.returncode == 0 and "restored the job's attempts records" in restored.stdout, restored
    assert "restored step_" not in restored.stdout and not (new / "checkpoints").exists()
    assert attempts(new).begin().line == "attempt 3 (1 of 2 failures used, 1 preemption)"


def test_a_shared_claim_restores_every_part_into_one_directory_with_one_commit(gateway, trained_on_worker_volumes,
                                                                                 tmp_path):
    """A tag written on per-worker volumes, restored onto a shared claim (node 0 alone restores there): every
    worker's files and one commit.json that lists them all, as a shared directory's would."""
    _, reference = trained_on_worker_volumes
    bucket = s3.new_bucket(gateway)
    uploaders = [objectstore.Uploader(settings(s3.worker_env(gateway, bucket, d, n))) for n, d in enumerate(reference)]
    for uploader in (*uploaders, uploaders[0]):
        uploader.step()
    shared = tmp_path / "shared"
    restored = s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(shared),
                                                          DS_NODE_RANK="0", DS_CHECKPOINT_STORAGE="shared",
                                                          DS_OBJECT_STORE_ROLE="worker"))
    assert restored.returncode == 0 and "(2 part(s)" in restored.stdout, restored.stdout + restored.stderr
    tag = shared / "step_00000016"
    assert checkpoint.is_complete(tag)
    files = set(checkpoint.read_manifest(tag)["files"])
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "mp_rank_00_model_states.pt"} <= files, files
    other = s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(tmp_path / "x"),
                                                       DS_NODE_RANK="1", DS_CHECKPOINT_STORAGE="shared",
                                                       DS_OBJECT_STORE_ROLE="worker"))
    assert other.returncode == 0 and not (tmp_path / "x").exists()


PART = objectstore.PART_SIZE


def test_a_tag_whose_upload_was_killed_is_never_restored_and_retention_keeps_the_newest(gateway, tmp_path):
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    for step in (10, 20):
        tag = directory / checkpoint.tag_for(step)
        tag.mkdir(parents=True)
        (tag / "shard.pt").write_bytes(os.urandom(1 << 20))
        (tag / "commit.json").write_text(json.dumps({"step": step, "files": checkpoint.files_of(tag)}))
        objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory)))).step()
    # A big tag, its upload killed with the uploader's process: parts of it in the bucket, no commit.
    big = directory / checkpoint.tag_for(30)
    big.mkdir()
    s3.write_data(big / "shard.pt", 600 << 20)
    (big / "commit.json").write_text(json.dumps({"step": 30, "files": checkpoint.files_of(big)}))
    uploader = s3.upload_round(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory)),
                               stderr=subprocess.PIPE)
    wait_for(lambda: uploader.poll() is not None or s3.read_so_far(uploader.pid, big / "shard.pt") > PART, 60,
             "the upload of step 30 to be under way")
    assert uploader.poll() is None, "the upload of 600 MB finished before it could be killed"
    os.kill(uploader.pid, signal.SIGKILL)
    uploader.wait()
    restored = s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(tmp_path / "new")))
    assert "restored step_00000020 from the bucket" in restored.stdout, restored.stdout + restored.stderr
    shutil.rmtree(big)
    # Retention, keep 1: the newest committed stays, and the cut tag, newer (from the bucket, it may be uploading);
    # once a newer one is committed, every older tag goes, committed or not. A restarted uploader puts no part twice.
    keep1 = objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory),
                                                       DS_OBJECT_STORE_KEEP="1")))
    keep1.step()
    assert keep1.status["bytes"] == 0 and keep1.status["uploaded_step"] == 20
    assert {t: e["committed"] for t, e in keep1.bucket_tags().items()} == {"step_00000020": True,
                                                                           "step_00000030": False}
    newer = directory / checkpoint.tag_for(40)
    newer.mkdir()
    (newer / "shard.pt").write_bytes(b"40")
    (newer / "commit.json").write_text(json.dumps({"step": 40, "files": checkpoint.files_of(newer)}))
    keep1.step()
    assert {t: e["committed"] for t, e in keep1.bucket_tags().items()} == {"step_00000040": True}


def test_every_workers_restore_chooses_the_tag_a_stopped_pod_was_still_uploading(gateway, tmp_path):
    """The pods of a preempted job end at different times, each uploading its part of the stop's checkpoint as it
    ends, and a pod's replacement starts once it ended: a restore that finds its own node's part of a tag newer than
    the newest committed waits for the others' and commits it, so every worker restores the same tag (choosing the
    newest committed at once, node 0 took step 10 and node 1 step 20 here, and no tag was held by both). A tag that
    lacks the restoring node's part is never completed and is passed over at once; one whose other part never comes
    is given up after the grace period."""
    bucket = s3.new_bucket(gateway)
    old = [tmp_path / "old-0", tmp_path / "old-1"]

    def save(node: int, step: int) -> None:
        tag = old[node] / checkpoint.tag_for(step)
        tag.mkdir(parents=True)
        (tag / f"shard-{node}.pt").write_bytes(os.urandom(1 << 16))
        (tag / "commit.json").write_text(json.dumps({"step": step, "files": checkpoint.files_of(tag)}))

    def restore(node: int, into: str, grace: str, **kwargs):
        env = s3.worker_env(gateway, bucket, tmp_path / into, node, DS_WORKER_GRACE_SECONDS=grace)
        return s3.run_objectstore("restore", env, **kwargs)

    uploaders = [objectstore.Uploader(settings(s3.worker_env(gateway, bucket, old[n], n))) for n in (0, 1)]

    def upload(node: int, step: int) -> None:
        uploaders[node].step()
        assert uploaders[node].status["uploaded_step"] == step, uploaders[node].status

    for step in (10, 20):
        save(0, step)
        if step == 10:
            save(1, step)
            upload(1, step)
        upload(0, step)
    assert {t: e["committed"] for t, e in uploaders[0].bucket_tags().items()} == {"step_00000010": True,
                                                                                   "step_00000020": False}
    log = tmp_path / "restore-0.log"
    with log.open("w") as out:
        env = s3.worker_env(gateway, bucket, tmp_path / "new-0", 0, DS_WORKER_GRACE_SECONDS="600")
        waiting = subprocess.Popen(s3.objectstore_argv("restore"), env={"PATH": os.environ["PATH"], **env},
                                   stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "waiting up to" in log.read_text() or waiting.poll() is not None, 60,
                 "node 0's restore to wait for node 1's part of step 20")
        assert "step_00000020 holds node 0's part and lacks node(s) 1's: waiting up to" in log.read_text(), \
            log.read_text()
        save(1, 20)  # pod 1's last upload, as it ends
        upload(1, 20)
        assert waiting.wait(timeout=60) == 0, log.read_text()
    finally:
        waiting.kill()
    said = log.read_text()
    assert "step_00000020: every part is in the bucket after" in said and \
        f"restored step_00000020 from the bucket into {tmp_path / 'new-0' / 'step_00000020'}" in said, said
    assert uploaders[0].bucket_tags()["step_00000020"]["committed"]
    second = restore(1, "new-1", "600")
    assert "restored step_00000020 from the bucket" in second.stdout, second.stdout + second.stderr
    # Step 30: node 1's part only (pod 0 ended without uploading its part of it): never completed.
    save(1, 30)
    upload(1, 30)
    passed_over = restore(0, "new-0b", "600")
    assert "restored step_00000020 from the bucket" in passed_over.stdout and "waiting" not in passed_over.stdout, \
        passed_over.stdout + passed_over.stderr
    given_up = restore(1, "new-1b", "2")
    assert "step_00000030 holds node 1's part and lacks node(s) 0's: waiting up to 2s" in given_up.stdout and \
        "step_00000030: still lacks node(s) 0's part after" in given_up.stdout and \
        "restored step_00000020 from the bucket" in given_up.stdout, given_up.stdout + given_up.stderr
    # Step 40 with parts 0 and 1 of this world and a part 2 of a three-worker job's (a tag name saved again after a
    # redeploy on another world size): not this world's to commit, nor to wait for.
    save(0, 40)
    save(1, 40)
    upload(0, 40)
    upload(1, 40)
    (tmp_path / "third" / "step_00000040").mkdir(parents=True)
    shutil.copytree(old[1] / "step_00000040", tmp_path / "third" / "step_00000040", dirs_exist_ok=True)
    third = objectstore.Uploader(settings(s3.worker_env(gateway, bucket, tmp_path / "third", 2, nodes=3)))
    third.step()
    assert third.status["uploaded_step"] == 40, third.status
    uploaders[0].step()
    assert uploaders[0].bucket_tags()["step_00000040"] == {"parts": {"0", "1", "2"}, "committed": False}
    other_world = restore(0, "new-0c", "600")
    assert "restored step_00000020 from the bucket" in other_world.stdout and "waiting" not in other_world.stdout, \
        other_world.stdout + other_world.stderr


def test_a_programs_own_tags_are_kept_and_restored_by_their_step_not_their_names_order(gateway, tmp_path):
    """A plain DeepSpeed program names its tags (`save_checkpoint(tag=f"step{n}")`) and marks the newest in `latest`:
    the bucket keeps and restores the newest by the step its name ends with (by name, step950 sorts after step1000)."""
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    env = s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory), DS_OBJECT_STORE_KEEP="1")
    for step in (950, 1000):
        (directory / f"step{step}").mkdir(parents=True)
        (directory / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(1 << 12))
        (directory / "latest").write_text(f"step{step}")
        uploader = objectstore.Uploader(settings(env))
        uploader.step()
        assert uploader.status["uploaded_step"] == step and uploader.status["committed_step"] == step
    assert {t: e["committed"] for t, e in uploader.bucket_tags().items()} == {"step1000": True}
    restored = s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(tmp_path / "new")))
    assert "restored step1000 from the bucket" in restored.stdout, restored.stdout + restored.stderr
    assert (tmp_path / "new" / "latest").read_text() == "step1000"


def test_a_project_that_took_anothers_release_name_finds_its_prefix_refused_and_a_reinstall_resumes(gateway,
                                                                                                     tmp_path):
    """The bucket's prefix is the release's name: a new project under a deleted one's name would restore that
    project's checkpoints. The identity at the prefix (ownership.py) tells a reinstall from a new team."""
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    tag = directory / checkpoint.tag_for(10)
    tag.mkdir(parents=True)
    (tag / "shard.pt").write_bytes(os.urandom(1 << 16))
    (tag / "commit.json").write_text(json.dumps({"step": 10, "files": checkpoint.files_of(tag)}))

    def restore(owner: str, into: str, **extra) -> subprocess.CompletedProcess:
        return s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(tmp_path / into),
                                                          DS_CHECKPOINT_OWNER=owner, **extra))

    first = restore("p-llama", "first")  # the project's first start: the prefix becomes its own
    assert first.returncode == 0 and "the prefix is project p-llama's" in first.stdout, first.stdout + first.stderr
    objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory)))).step()
    again = restore("p-llama", "reinstall")  # a reinstall of the same project resumes
    assert again.returncode == 0 and "restored step_00000010 from the bucket" in again.stdout, again.stderr
    taken = restore("p-newteam", "taken")
    assert taken.returncode == 1 and not (tmp_path / "taken").exists(), taken.stdout + taken.stderr
    assert f"s3://{bucket}/ml/job/ holds the data of project identity p-llama, not of this project (p-newteam)" \
        in taken.stderr and len(taken.stderr.strip().splitlines()) == 1, taken.stderr
    adopted = restore("p-newteam", "adopted", DS_CHECKPOINT_ADOPT="p-llama")  # the platform's explicit word
    assert adopted.returncode == 0 and "(adopted from p-llama)" in adopted.stdout, adopted.stdout + adopted.stderr
    assert "restored step_00000010 from the bucket" in adopted.stdout
    assert restore("p-llama", "old").returncode == 1  # the prefix is the new project's now
    # A record that names no identity (a program cannot write the bucket, but a person or another tool can): refused.
    s3.client(gateway).put_object(bucket, "ml/job/owner.json", io.BytesIO(b"[1]"), 3)
    unreadable = restore("p-newteam", "unreadable")
    assert unreadable.returncode == 1 and "an unreadable owner record" in unreadable.stderr, unreadable.stderr


def test_namespaces_on_one_gateway_are_users_of_tenants_of_their_own_with_quotas(gateway, tmp_path):
    """docs/checkpoints.md's isolation on a shared gateway: each namespace's credentials Secret holds a user of its
    own RGW tenant with a user quota. The same values (bucket ml-checkpoints) name each tenant's own bucket; one
    tenant's program that fills its quota stops only its own uploads, which say why; its keys reach nothing of the
    other's."""
    team_a = s3.tenant_user(gateway, "team-a", quota_bytes=4 << 20)
    team_b = s3.tenant_user(gateway, "team-b")
    for env in (team_a, team_b):
        s3.client(env).make_bucket("ml-checkpoints")
    for env, size in ((team_a, 8 << 20), (team_b, 1 << 20)):  # team a's tag is over its quota
        tag = tmp_path / env["AWS_ACCESS_KEY_ID"] / checkpoint.tag_for(10)
        tag.mkdir(parents=True)
        s3.write_data(tag / "shard.pt", size)
        (tag / "commit.json").write_text(json.dumps({"step": 10, "files": checkpoint.files_of(tag)}))
    uploaders = {name: objectstore.Uploader(settings(s3.store_env(env, "ml-checkpoints", DS_CHECKPOINT_DIR=str(
        tmp_path / env["AWS_ACCESS_KEY_ID"])))) for name, env in (("a", team_a), ("b", team_b))}
    for uploader in uploaders.values():
        uploader.step()
    assert "QuotaExceeded" in (uploaders["a"].status["error"] or ""), uploaders["a"].status
    assert uploaders["a"].status["committed_step"] is None
    assert not uploaders["b"].status["error"] and uploaders["b"].status["committed_step"] == 10, uploaders["b"].status
    listed = {o.object_name for o in s3.client(team_a).list_objects("ml-checkpoints", recursive=True)}
    assert not any(name.endswith("shard.pt") for name in listed), listed  # its own bucket: none of team b's
    assert any(o.object_name.endswith("shard.pt")
               for o in s3.client(team_b).list_objects("ml-checkpoints", recursive=True))


def test_a_tag_deleted_while_it_uploads_is_never_committed_and_the_next_one_goes_up(gateway, tmp_path):
    """A program's own rotation (a Trainer's save_total_limit) deletes the tag the sidecar is uploading: the files
    not yet read are gone, and the part is neither recorded nor committed; the newer tag goes up whole."""
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    doomed = directory / "checkpoint-100"
    doomed.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt"):
        s3.write_data(doomed / name, 16 * PART)  # the first one takes long enough to delete the tag before the second
    (doomed / "trainer_state.json").write_text('{"global_step": 100}')
    uploader = s3.upload_round(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: uploader.poll() is not None or any(s3.read_so_far(uploader.pid, doomed / name) > PART
                                                        for name in ("model.safetensors", "optimizer.pt")),
             60, "the upload of checkpoint-100 to be under way")
    shutil.rmtree(doomed)  # the rotation, mid-upload
    out, _ = uploader.communicate(timeout=120)
    assert uploader.returncode == 0, out
    assert "checkpoint-100: " in out and "went away while it was uploading: not committed" in out, out
    names = {o.object_name for o in s3.client(gateway).list_objects(bucket, prefix="ml/job/", recursive=True)}
    assert not any(n.endswith(("0.json", "committed.json")) for n in names), names
    newer = directory / "checkpoint-200"
    newer.mkdir()
    (newer / "model.safetensors").write_bytes(b"weights")
    (newer / "trainer_state.json").write_text('{"global_step": 200}')
    objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory)))).step()
    restored = s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(tmp_path / "new")))
    assert "restored checkpoint-200 from the bucket" in restored.stdout, restored.stdout + restored.stderr


def test_links_fifos_and_devices_planted_in_a_checkpoint_are_neither_followed_nor_uploaded(gateway, tmp_path):
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    tag = directory / "step_00000005"
    (tag / "sub").mkdir(parents=True)
    (tag / "shard.pt").write_bytes(b"weights")
    secret = tmp_path / "token"
    secret.write_text("the sidecar's token")
    (tag / "token").symlink_to(secret)
    (tag / "linked-dir").symlink_to(tmp_path)
    os.mkfifo(tag / "sub" / "fifo")
    (tag / "commit.json").write_text(json.dumps({"step": 5, "files": {"shard.pt": 7}}))
    uploader = objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory))))
    started = time.monotonic()
    uploader.step()  # does not block on the FIFO
    assert time.monotonic() - started < 30 and uploader.status["error"] == ""
    names = sorted(o.object_name for o in s3.client(gateway).list_objects(bucket, prefix="ml/job/", recursive=True))
    assert names == ["ml/job/checkpoints/step_00000005/committed.json",
                     "ml/job/checkpoints/step_00000005/parts/0.json",
                     "ml/job/checkpoints/step_00000005/parts/0/commit.json",
                     "ml/job/checkpoints/step_00000005/parts/0/shard.pt"], names
    # commit.json itself a FIFO: the tag is not complete, and nothing blocks
    os.replace(tag / "commit.json", tmp_path / "kept.json")
    os.mkfifo(tag / "commit.json")
    assert checkpoints.complete_tags(Tree(directory)) == []


def test_the_bucket_gets_what_the_volume_holds_once_per_inode_and_a_part_over_the_limit_goes_nowhere(gateway,
                                                                                                       tmp_path):
    """A program leaves a 1 GiB file with three small data regions and 1,200 hard links of its 1 MiB shard in a
    complete checkpoint: its part sends what the volume holds, each inode once, and the restore brings back the holes
    and the links. A part over checkpoints.objectStore.maxPartGiB is not uploaded, its tag never committed, in one
    line; a manifest whose links or regions do not fit its files is refused by the restore."""
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    tag = directory / checkpoint.tag_for(10)
    (tag / "links").mkdir(parents=True)
    shard = os.urandom(1 << 20)
    (tag / "shard.pt").write_bytes(shard)
    for i in range(1200):
        os.link(tag / "shard.pt", tag / "links" / f"copy-{i:04d}.pt")
    with open(tag / "sparse.bin", "wb") as f:
        for offset, data in ((0, b"head"), (512 << 20, b"middle"), (1 << 30, b"tail")):
            f.seek(offset)
            f.write(data)
    (tag / "commit.json").write_text(json.dumps({"step": 10, "files": checkpoint.files_of(tag)}))
    inodes = {(i.st_dev, i.st_ino): i for i in (p.stat() for p in tag.rglob("*") if p.is_file())}
    on_volume = sum(i.st_blocks * 512 for i in inodes.values())  # what `du` says the tag holds
    uploader = objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory))))
    uploader.step()
    assert uploader.status["error"] == "" and uploader.status["committed_step"] == 10, uploader.status
    prefix = "ml/job/checkpoints/step_00000010/parts/0/"
    objects = {o.object_name[len(prefix):]: o.size for o in s3.client(gateway).list_objects(bucket, prefix=prefix,
                                                                                             recursive=True)}
    shard_name = next(name for name in objects if name not in ("sparse.bin", "commit.json"))  # one of its 1,201 names
    assert set(objects) == {shard_name, "sparse.bin", "commit.json"}, sorted(objects)[:5]
    assert objects[shard_name] == 1 << 20 and objects["sparse.bin"] < 1 << 20, objects
    assert sum(objects.values()) <= on_volume < 3 << 20, (objects, on_volume)
    print(f"\n1 GiB + 1,201 names of 1 MiB ({(1 << 30) + 1201 * (1 << 20):,} bytes by name) sent as "
          f"{sum(objects.values()):,} bytes; the volume holds {on_volume:,}")
    restored = s3.run_objectstore("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(tmp_path / "new")))
    assert "restored step_00000010 from the bucket" in restored.stdout, restored.stdout + restored.stderr
    back = tmp_path / "new" / "step_00000010"
    assert checkpoint.is_complete(back)
    assert (back / "shard.pt").read_bytes() == shard and (back / "shard.pt").stat().st_nlink == 1201
    assert (back / "links" / "copy-0777.pt").stat().st_ino == (back / "shard.pt").stat().st_ino
    sparse = back / "sparse.bin"
    assert sparse.stat().st_size == (1 << 30) + 4 and sparse.stat().st_blocks * 512 < 1 << 20
    with open(sparse, "rb") as f:
        assert [(f.seek(o), f.read(n))[1] for o, n in ((0, 4), (512 << 20, 6), (1 << 30, 4), (4096, 4))] == \
            [b"head", b"middle", b"tail", bytes(4)]
    # Over the limit: the next tag is not uploaded, the bucket keeps step 10, and one line says why.
    newer = directory / checkpoint.tag_for(20)
    newer.mkdir()
    (newer / "shard.pt").write_bytes(shard)
    (newer / "commit.json").write_text(json.dumps({"step": 20, "files": checkpoint.files_of(newer)}))
    limited = objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory),
                                                         DS_OBJECT_STORE_MAX_PART_BYTES=str(512 << 10))))
    limited.step()
    limited.step()
    assert re.fullmatch(r"step_00000020 not uploaded: node 0's part holds 0\.0 GiB of data \(each file once, holes "
                        r"left out\), over checkpoints\.objectStore\.maxPartGiB \(0\.000488281\); the bucket keeps its "
                        r"older committed tags", limited.status["error"]), limited.status["error"]
    assert {t: e["committed"] for t, e in limited.bucket_tags().items()} == {"step_00000010": True}
    # A manifest whose regions run past its file, or whose link names a file it does not list: refused, one line.
    manifest_key = "ml/job/checkpoints/step_00000010/parts/0.json"
    manifest = json.loads(s3.client(gateway).get_object(bucket, manifest_key).read())
    for hostile in ({**manifest, "regions": {"sparse.bin": [[0, 1 << 40]]}},
                    {**manifest, "links": {"links/copy-0001.pt": "../../other-release/shard.pt"}}):
        data = json.dumps(hostile).encode()
        s3.client(gateway).put_object(bucket, manifest_key, io.BytesIO(data), len(data))
        refused = s3.run_objectstore("restore", s3.store_env(gateway, bucket,
                                                             DS_CHECKPOINT_DIR=str(tmp_path / "hostile")))
        assert refused.returncode == 1 and "node 0's manifest in the bucket lists links or data regions that do not " \
            "fit its files: not restored" in refused.stderr, refused.stdout + refused.stderr
        assert not list((tmp_path / "hostile").glob("step_*"))


def test_the_jobs_records_in_the_bucket_are_pruned_as_on_the_volume_and_bounded(gateway, tmp_path):
    """The goodput records lie on the checkpoint volume, which the program writes: a file over the cap there is not
    mirrored, and a job's records pruned on the volume go from the bucket too."""
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    goodput = directory / "_job" / "goodput"
    for job in ("old", "new"):
        (goodput / job).mkdir(parents=True)
        (goodput / job / "00000000000001-0001.json").write_text('{"begun": 1}')
    (goodput / "new" / "huge.json").write_bytes(b"x" * (objectstore.RECORD_BYTES + 1))
    uploader = objectstore.Uploader(settings(s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory))))

    def mirrored() -> list[str]:
        return sorted(o.object_name.removeprefix("ml/job/job/goodput/") for o in s3.client(gateway).list_objects(
            bucket, prefix="ml/job/job/goodput/", recursive=True))

    uploader.step()
    assert mirrored() == ["new/00000000000001-0001.json", "old/00000000000001-0001.json"]
    shutil.rmtree(goodput / "old")  # what Goodput's pruning does (protocol.KEEP_JOBS)
    uploader.step()
    assert mirrored() == ["new/00000000000001-0001.json"]
    shutil.rmtree(goodput)  # an empty (or unreadable) tree is not mirrored as nothing
    uploader.step()
    assert mirrored() == ["new/00000000000001-0001.json"]


@pytest.mark.parametrize("case", ["bucket", "keys", "endpoint", "tls without the CA", "tls"])
def test_a_store_the_pods_cannot_use_is_refused_before_any_rank_in_one_line_naming_the_value(gateway, case):
    bucket = s3.new_bucket(gateway)
    env = s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR="/nonexistent")
    if case == "bucket":
        env["DS_OBJECT_STORE_BUCKET"] = "no-such-bucket"
    elif case == "keys":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
    elif case == "endpoint":
        env["DS_OBJECT_STORE_ENDPOINT"] = "http://127.0.0.1:9"
    else:
        env["DS_OBJECT_STORE_ENDPOINT"] = gateway["LOCAL_S3_TLS_ENDPOINT"]
        if case == "tls":
            env["DS_OBJECT_STORE_CA_FILE"] = gateway["LOCAL_S3_CA_BUNDLE"]
    result = s3.run_objectstore("check", env)
    if case == "tls":
        assert result.returncode == 0 and "answers for ml/job/" in result.stdout, result.stderr
        return
    assert result.returncode == 1 and result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result
    expected = {"bucket": "checkpoints.objectStore.bucket 'no-such-bucket': no such bucket",
                "keys": "checkpoints.objectStore.credentialsSecret 'ml-checkpoints-s3': the bucket",
                "endpoint": "checkpoints.objectStore.endpoint 'http://127.0.0.1:9': unreachable",
                "tls without the CA": "checkpoints.objectStore.endpoint"}[case]
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_sidecar_uploads_in_the_background_and_serves_how_far_the_bucket_is(gateway, tmp_path):
    """The sidecar as a worker pod's runs it, with the chart's object-store env: the uploads run in a thread
    of their own, and its metrics say the committed step and the lag."""
    bucket = s3.new_bucket(gateway)
    directory, state = tmp_path / "ckpt", tmp_path / "ranks"
    state.mkdir()
    tag = directory / "step_00000012"
    tag.mkdir(parents=True)
    (tag / "shard.pt").write_bytes(os.urandom(3 << 20))
    (tag / "commit.json").write_text(json.dumps({"step": 12, "files": checkpoint.files_of(tag)}))
    attempt = tmp_path / "ledger" / "job-a" / "0002"
    attempt.mkdir(parents=True)
    port = free_port()
    env = {"PATH": os.environ["PATH"], protocol.STATE_DIR_ENV: str(state), "PYTHONUNBUFFERED": "1",
           "DS_NODE_RANK": "0", "KUBECONFIG": str(tmp_path / "none"),
           **s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory), DS_OBJECT_STORE_ROLE="worker",
                          DS_ATTEMPTS_DIR=str(tmp_path / "ledger"), DS_LEDGER_ON_WORKER0="true")}
    sidecar = subprocess.Popen([*pod_program("sidecar"), "--progress", "--metrics-port", str(port)], env=env,
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()
        except OSError:
            return ""

    try:
        wait_for(lambda: "deepspeed_training_checkpoint_committed_step 12.0" in scrape(), 60,
                 "the committed step in the sidecar's metrics", scrape)
        text = scrape()
        assert "deepspeed_training_checkpoint_upload_lag_steps 0.0" in text
        assert "deepspeed_training_checkpoint_upload_failures 0.0" in text
        assert re.search(r"^deepspeed_training_checkpoint_upload_bytes_per_second \d", text, re.M)
        # What the pod writes last, as its main container ends (a preemption marked in the ledger), goes up on
        # the SIGTERM the sidecar gets after it.
        (attempt / "stopped-worker-0").write_text("")
    finally:
        sidecar.send_signal(signal.SIGTERM)
        out, _ = sidecar.communicate(timeout=30)
    assert f"uploading checkpoints to {bucket} under ml/job/" in out, out
    assert sidecar.returncode == 0, out
    names = {o.object_name for o in s3.client(gateway).list_objects(bucket, prefix="ml/job/job/", recursive=True)}
    assert "ml/job/job/attempts/job-a/0002/stopped-worker-0" in names, names
