"""The object store's long drills (`make drill-objectstore`; CI runs the short ones in tests/test_objectstore.py
and the cluster tier): 20 uploads killed at random points, a resume from the bucket at another world size against
the same resume from a shared claim, and the gateway frozen for 60 s under a training run. Each prints its row of
the table the closing notes carry. Real parts: the RADOS Gateway of ../shared/s3, podruntime/objectstore.py and
podruntime/sidecar.py as the pods run them, the train package on DeepSpeed's engine."""

import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from podruntime import checkpoints, objectstore, protocol
from tests.support import s3
from tests.support.chart import pod_program
from tests.support.harness import wait_for
from tests.support.ports import free_port
from tests.support.train_run import TINY, cpu_ds_config, launch, metrics, run_per_worker, run_train, write_ds_config
from train import checkpoint

pytestmark = pytest.mark.skipif(
    "objectstore" not in os.environ.get("DS_DRILLS", "") or s3.unavailable() is not None,
    reason=s3.unavailable() or "a long drill: `make drill-objectstore` runs it (DS_DRILLS=objectstore)")
PART = 16 << 20  # objectstore.PART_SIZE's order: a kill lands inside a multipart upload


@pytest.fixture(scope="module")
def gateway():
    return s3.up()


def run_script(command: str, env: dict) -> subprocess.CompletedProcess:
    return s3.run_objectstore(command, env, timeout=300)


def uploader_process(env: dict) -> subprocess.Popen:
    """One round of the sidecar's uploads, as a process that can be killed."""
    return s3.upload_round(env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def write_tag(directory: Path, step: int, sizes: list[int]) -> Path:
    tag = directory / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    for index, size in enumerate(sizes):
        s3.write_data(tag / f"shard_{index}.pt", size, head=os.urandom(1 << 16))  # a wrong shard restored shows
    (tag / "commit.json").write_text(json.dumps({"step": step, "files": checkpoint.files_of(tag)}))
    return tag


def test_twenty_uploads_killed_mid_tag_never_leave_a_tag_that_is_restored(gateway, tmp_path):
    """Rounds until 20 are killed: a new tag (2-3 shards, 48-192 MB) whose upload is killed at a random point (one
    that ends first is not counted), then a restore into an empty volume, which must bring back the newest
    COMMITTED tag, whole; then the round's tag is uploaded to the end. 0 of 20 restores may come from the cut tag.
    The parts of the cut uploads stay in the bucket (a lifecycle rule that aborts incomplete multipart uploads
    clears them; this gateway has none): MEMSTORE_BYTES holds them all."""
    bucket = s3.new_bucket(gateway)
    directory = tmp_path / "ckpt"
    env = s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory), DS_OBJECT_STORE_KEEP="2")
    rng = random.Random(36)
    committed, from_cut, killed_after, round_ = None, 0, [], 0
    while len(killed_after) < 20:
        round_ += 1
        assert round_ <= 40, f"only {len(killed_after)} of {round_ - 1} uploads were caught before they ended"
        step = round_ * 10
        tag = write_tag(directory, step, [rng.randint(24, 64) << 20 for _ in range(rng.randint(2, 3))])
        total = sum(checkpoint.files_of(tag).values())
        cut_at = rng.randint(PART, total - 2 * PART)
        uploader = uploader_process(env)
        deadline = time.monotonic() + 120
        while uploader.poll() is None and s3.read_so_far(uploader.pid, tag) < cut_at:  # a tight look: 5 ms
            assert time.monotonic() < deadline, f"round {round_}'s upload never reached byte {cut_at}"
            time.sleep(0.005)
        if uploader.poll() is None:
            killed_after.append(s3.read_so_far(uploader.pid, tag) / total)
            os.kill(uploader.pid, signal.SIGKILL)
        uploader.wait()
        target = tmp_path / f"restore-{round_}"
        restored = run_script("restore", {**env, "DS_CHECKPOINT_DIR": str(target)})
        assert restored.returncode == 0, restored.stderr
        got = re.search(r"restored (step_\d+) from the bucket", restored.stdout)
        if got and got[1] == tag.name and uploader.returncode != 0:
            from_cut += 1
        expected = committed if uploader.returncode != 0 else tag.name
        assert (got[1] if got else None) == expected, restored.stdout + restored.stderr
        if got:
            assert checkpoint.is_complete(target / got[1])
            assert checkpoint.files_of(target / got[1]) == checkpoint.files_of(directory / got[1])
        finished = run_script("check", env)  # the store answers; then this round's tag to the end
        assert finished.returncode == 0, finished.stderr
        last = uploader_process(env)
        assert last.wait(timeout=300) == 0
        committed = tag.name
        for old in checkpoint.tags_newest_first(directory)[2:]:
            subprocess.run(["rm", "-rf", str(old)], check=True)
        subprocess.run(["rm", "-rf", str(target)], check=True)
    assert from_cut == 0
    print(f"\n| uploads killed mid-tag | {len(killed_after)} of {round_} rounds killed (at {min(killed_after):.0%}-"
          f"{max(killed_after):.0%} of the tag) | restores after a kill: {len(killed_after)}, from a cut tag: "
          f"{from_cut} |")


@pytest.mark.parametrize("stage", [1, 2])
def test_a_job_resumed_from_the_bucket_on_three_ranks_trains_as_one_resumed_from_a_shared_claim(
        gateway, tmp_path, stage):
    """2 workers on their own volumes, 8 steps (checkpoint at 4 and 8), both parts uploaded and committed; then a
    shared claim on 3 ranks, restored from the bucket (every part into one directory), resumes through the
    universal conversion, side by side with the same 8 steps on a shared claim resumed on 3 ranks.
    ZeRO-3 is left out: a ZeRO-3 run that loads a universal checkpoint and then saves breaks its checkpoints
    (DeepSpeed #7546, ../shared/MEASURED.md)."""
    ds_config = write_ds_config(tmp_path, cpu_ds_config(stage=stage, micro=2, accum=None, train_batch_size=12,
                                                        checkpoint={"use_node_local_storage": True}))
    common = ["--ds-config", str(ds_config), "--checkpoint-every", "4", "--log-every", "1", *TINY]
    workers = [tmp_path / "worker-0", tmp_path / "worker-1"]
    first = run_per_worker([*common, "--steps", "8"], workers)
    assert first.returncode == 0, first.stdout[-4000:]
    bucket = s3.new_bucket(gateway)
    uploaders = [objectstore.Uploader(objectstore.Settings(env=s3.worker_env(gateway, bucket, d, n)))
                 for n, d in enumerate(workers)]
    for uploader in (*uploaders, uploaders[0]):
        uploader.step()
    assert uploaders[0].status["committed_step"] == 8
    from_bucket = tmp_path / "from-bucket"
    restored = run_script("restore", s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(from_bucket),
                                                  DS_NODE_RANK="0", DS_CHECKPOINT_STORAGE="shared",
                                                  DS_OBJECT_STORE_ROLE="worker"))
    assert restored.returncode == 0, restored.stderr
    # The reference: the same 8 steps on a shared claim (one directory every rank sees), resumed on 3 ranks.
    claim = tmp_path / "claim"
    shared_config = write_ds_config(tmp_path, cpu_ds_config(stage=stage, micro=2, accum=None, train_batch_size=12),
                                    name="shared.json")
    reference = run_train(["--ds-config", str(shared_config), *common[2:], "--steps", "8", "--checkpoint-dir",
                           str(claim)])
    assert reference.returncode == 0, reference.stdout[-4000:]
    out = {}
    for name, directory in (("bucket", from_bucket), ("claim", claim)):
        config = ds_config if name == "bucket" else shared_config
        result = run_train(["--ds-config", str(config), *common[2:], "--steps", "12", "--checkpoint-dir",
                            str(directory)], ranks=3)
        assert result.returncode == 0, result.stdout[-4000:]
        assert f"resumed from {directory / 'step_00000008'} at step 8" in result.stdout, result.stdout[-4000:]
        out[name] = dict(metrics(directory)["losses"])
    assert sorted(out["bucket"]) == list(range(9, 13))
    worst = max(abs(out["bucket"][s] - out["claim"][s]) for s in range(9, 13))
    assert worst <= 1e-6, out
    print(f"\n| resume from the bucket, ZeRO-{stage}, 2 -> 3 ranks | loss at step 9: {out['bucket'][9]:.4f} (claim: "
          f"{out['claim'][9]:.4f}) | max difference steps 9-12: {worst:.1e} |")


def test_the_gateway_frozen_for_60s_training_goes_on_the_lag_shows_and_the_uploads_catch_up(gateway, tmp_path):
    """A 2-rank run saving every 20 steps with the worker pod's sidecar (podruntime/sidecar.py, its uploads thread and
    metrics); the gateway frozen (SIGSTOP) for 60 s: the steps go on, the sidecar's lag grows, and after the thaw
    the bucket catches up with the volume."""
    bucket = s3.new_bucket(gateway)
    directory, state = tmp_path / "ckpt", tmp_path / "ranks"
    state.mkdir()
    ds_config = write_ds_config(tmp_path, cpu_ds_config())
    port = free_port()
    env = {"PATH": os.environ["PATH"], protocol.STATE_DIR_ENV: str(state), "PYTHONUNBUFFERED": "1",
           "DS_NODE_RANK": "0", "KUBECONFIG": str(tmp_path / "none"),
           **s3.store_env(gateway, bucket, DS_CHECKPOINT_DIR=str(directory), DS_OBJECT_STORE_ROLE="worker")}
    sidecar = subprocess.Popen([*pod_program("sidecar"), "--progress",
                                "--metrics-port", str(port)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    ranks = launch(["--ds-config", str(ds_config), "--steps", "1000000", "--checkpoint-every", "20",
                    "--log-every", "1000", "--checkpoint-dir", str(directory), *TINY])
    try:
        ranks.communicate(timeout=0.01)
    except subprocess.TimeoutExpired:
        pass  # its output is now read in the background

    def metric(name: str) -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        found = re.search(rf"^deepspeed_training_{name} (\S+)$", text, re.M)
        return float(found[1]) if found else None

    def newest_local() -> int:
        found = checkpoint.tags_newest_first(directory) if directory.is_dir() else []
        complete = [t for t in found if checkpoint.is_complete(t)]
        return checkpoints.step_of(complete[0].name) if complete else 0

    try:
        wait_for(lambda: (metric("checkpoint_committed_step") or 0) >= 20, 180, "a first tag in the bucket")
        before, frozen_at = newest_local(), time.monotonic()
        subprocess.run(["bash", str(s3.SCRIPT), "pause", str(s3.STATE)], check=True)
        most_lag = 0.0
        try:
            while time.monotonic() - frozen_at < 60:
                most_lag = max(most_lag, metric("checkpoint_upload_lag_steps") or 0.0)
                time.sleep(2)
            during = newest_local() - before
        finally:
            subprocess.run(["bash", str(s3.SCRIPT), "resume", str(s3.STATE)], check=True)
        thawed = time.monotonic()
        assert during > 0, "no checkpoint on the volume while the gateway was frozen"
        assert most_lag >= 20, f"the lag never showed: {most_lag}"
        target = newest_local()
        wait_for(lambda: (metric("checkpoint_committed_step") or 0) >= target, 300, "the bucket to catch up")
        caught_up = time.monotonic() - thawed
    finally:
        os.killpg(ranks.pid, signal.SIGKILL)
        ranks.communicate()
        sidecar.send_signal(signal.SIGTERM)
        out, _ = sidecar.communicate(timeout=120)
    print(f"\n| gateway frozen 60 s | {during} steps checkpointed meanwhile | largest lag {most_lag:.0f} steps | "
          f"failures retried: {metric_or(out)} | caught up {caught_up:.0f} s after the thaw |")


def metric_or(sidecar_out: str) -> int:
    return sidecar_out.count("upload failed")
