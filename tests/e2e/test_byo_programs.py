"""Teams' own programs through the rendered chart, on network-namespace hosts (see harness.py): a Hugging Face
Trainer script (`huggingface` convention, ds_config full of "auto"), a DeepSpeedExamples-style argparse module
(`deepspeed` convention) and a script whose arguments carry the chart's paths (`none` convention)."""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from scripts.jinja_render import render as render_template
from tests.support.chart import ROOT
from tests.support.chart_pods import COLLECTIVE_TIMEOUT_MINUTES, REASON, UID, e2e_values, render
from tests.support.harness import Cluster, wait, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
transformers = pytest.importorskip("transformers", reason="the Hugging Face stack (pyproject's hf extra)")
pytest.importorskip("accelerate", reason="Trainer needs accelerate (pyproject's hf extra)")


def program_values(shared_dir, **train) -> dict:
    values = e2e_values(shared_dir)
    values["train"] = train
    return values


def hf_ds_config() -> dict:
    """The preset a Trainer project uses (templates/ds_config/hf-zero2-auto.json.j2), as the glue renders it."""
    return json.loads(render_template(ROOT / "templates", "ds_config/hf-zero2-auto.json.j2", {}))


HF_ARGS = ["--use_cpu", "--per_device_train_batch_size=4", "--learning_rate=2e-3", "--logging_steps=2",
           "--save_steps=5", "--report_to=none", "--seed=0", "--dataloader_num_workers=0"]


def trainer_values(shared_dir, max_steps: int) -> dict:
    """The Trainer example (examples/hf_trainer.py) on the chart's default storage, a volume per worker pod."""
    values = program_values(shared_dir, script=str(ROOT / "examples" / "hf_trainer.py"), argsConvention="huggingface",
                            fillsDsConfigAuto=True, args=[*HF_ARGS, f"--max_steps={max_steps}"])
    values["deepspeed"]["config"] = hf_ds_config()
    del values["checkpoints"]
    return values


def test_a_hugging_face_trainer_program_resumes_and_its_hang_is_caught_by_the_heartbeat(shared_dir, tmp_path):
    """On the chart's default storage, a volume per worker pod: the chart passes --save_on_each_node and DeepSpeed's
    use_node_local_storage, so each worker keeps what its ranks load. A redeploy is played by copying each worker's
    volume into the next cluster's pod of the same index (a StatefulSet's claim per worker would keep it)."""
    kept = [tmp_path / "worker-0", tmp_path / "worker-1"]

    def hf_values(max_steps):
        values = trainer_values(shared_dir, max_steps)
        values["hangDetection"] = {"enabled": True, "startupSeconds": 120, "stepSeconds": 10}
        return values

    with Cluster(render(hf_values(10))) as cluster:
        code, log = cluster.run_launcher(timeout=300)
        for worker, copy in zip(cluster.pods_of("worker"), kept, strict=True):
            subprocess.run(["cp", "-a", str(cluster.checkpoint_dir(worker)), str(copy)], check=True)
    assert code == 0, log[-5000:]
    assert "--deepspeed /etc/deepspeed/config/ds_config.json --output_dir /checkpoints" in log
    assert f"--ddp_timeout {COLLECTIVE_TIMEOUT_MINUTES * 60}" in log  # the chart's one collective timeout
    assert "--save_on_each_node true" in log  # per-worker volumes: each worker saves the Trainer's files too
    for copy in kept:  # each worker holds a whole checkpoint for its ranks: the Trainer's files and DeepSpeed's
        for tag in ("checkpoint-5", "checkpoint-10"):
            assert (copy / tag / "trainer_state.json").is_file(), sorted(p.name for p in copy.rglob("*"))
            assert list((copy / tag).glob("global_step*/mp_rank_00_model_states.pt")), sorted(copy.rglob("*"))
            # DeepSpeed's marker, which global rank 0 writes; on worker 1 the chart's callback (mark_latest).
            assert (copy / tag / "latest").read_text() == f"global_step{tag.split('-')[1]}"
    history = json.loads((kept[0] / "log_history.json").read_text())
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    assert goodput_split(log)["attempts"] == 1, log[-3000:]  # the callback's goodput line, as the train package's

    # The next attempt (a redeploy that asks for more steps) resumes from checkpoint-10; one of its ranks then
    # stops. The Trainer's own collective timeout would wait; the heartbeat of the example's one-line callback
    # ends the attempt within the budget, and the retry in the pod resumes from the newest checkpoint.
    with Cluster(render(hf_values(60))) as cluster:
        workers = cluster.start_workers()
        volumes = [cluster.checkpoint_dir(w) for w in workers]
        for copy, volume in zip(kept, volumes, strict=True):
            subprocess.run(["cp", "-a", f"{copy}/.", str(volume)], check=True)
        launcher = cluster.pods_of("launcher")[0]
        run = cluster.start(launcher)
        wait_for(lambda: all((v / "checkpoint-20").is_dir() for v in volumes), 180, "checkpoint-20", launcher.log)
        stop_in_a_step(cluster, workers[1], launcher)
        stopped_at, stopped_wall = time.monotonic(), time.time()
        detected_at = wait_for(lambda: "hang on" in launcher.log(), 60, "the hang report", launcher.log)
        code = wait(run, timeout=300)
        log = launcher.log()
        reports = [p for v in volumes for p in (v / "_job" / "diagnostics").glob("run-*/*.txt")]
        reported = min(p.stat().st_mtime for p in reports) - stopped_wall if reports else None
        published = cluster.progress(workers[0])  # rank 0's, for the progress sidecar: the split unrounded
    assert code == 0, log[-5000:]
    assert "hf_trainer: resuming from /checkpoints/checkpoint-10" in log
    assert detected_at - stopped_at < 10 + 15, log[-3000:]
    assert re.search(r"rank 1 \(pid \d+, local rank 0\) on \S+: process stopped", log), log[-4000:]
    retry = log[log.rindex("attempts: attempt 2 ("):]
    resumed = re.search(r"hf_trainer: resuming from /checkpoints/checkpoint-(\d+)", retry)
    assert resumed, retry[-3000:]
    assert "hf_trainer: done at global step 60" in retry
    # Goodput from the callback, over this job's two attempts: the buckets add up, time hung runs from the last step
    # to the watchdog's first report (the test's stop, within a step), and the steps after the checkpoint the retry
    # resumed from are recomputation.
    assert goodput_split(retry)["attempts"] == 2
    split = published["goodput"]
    assert published["state"] == "done" and published["goodput_line"] in retry, published
    stopped_step = max(int(n) for n in re.findall(r"made no progress for \d+s \(budget \d+s, \w+ after step (\d+)\)",
                                                  log))
    buckets = ("productive", "startup", "restore", "save", "recomputation", "hung", "unaccounted")
    assert abs(sum(split[b] for b in buckets) - split["wall"]) < 0.05, split
    assert split["attempts"] == 2 and abs(split["unaccounted"]) < max(0.02 * split["wall"], 3), split
    assert reported is not None and abs(split["hung"] - reported) < 3, (split, reported)
    assert (split["recomputation"] > 0) == (stopped_step > int(resumed[1])), (split, stopped_step, resumed[1])
    assert split["productive"] > 0 and split["startup"] > 0, split
    print(published["goodput_line"], f"| test's clock: hung {reported:.1f}s")


def goodput_split(log: str) -> dict:
    """The last goodput line (train/goodput.py's describe) as numbers; its buckets add up to its wall time."""
    line = re.findall(r"goodput [\d.]+% \| wall ([\d.]+)s = productive ([\d.]+)s \+ start-up ([\d.]+)s \+ restore "
                      r"([\d.]+)s \+ save ([\d.]+)s \+ recomputation ([\d.]+)s \+ hung ([\d.]+)s \+ unaccounted "
                      r"(-?[\d.]+)s \((\d+) attempts?\)", log)
    assert line, log[-3000:]
    names = ("wall", "productive", "startup", "restore", "save", "recomputation", "hung", "unaccounted")
    split = {name: float(value) for name, value in zip(names, line[-1], strict=False)}
    split["attempts"] = int(line[-1][-1])
    assert abs(sum(split[name] for name in names[1:]) - split["wall"]) < 0.5, split  # each rounded to 0.1 s
    return split


def stop_in_a_step(cluster: Cluster, worker, launcher) -> None:
    """SIGSTOP the worker's rank while it trains, not while it saves (a save is judged by the checkpoint budget,
    not the step budget): stopped, its heartbeat file can no longer change, so it says where the stop landed."""
    pid = cluster.rank_pids(worker, ranks_only=True)[0]

    def stopped_training() -> bool:
        if not any(state.startswith("training ") for state in cluster.rank_states(worker)):
            return False
        os.kill(pid, signal.SIGSTOP)
        if any(state.startswith("training ") for state in cluster.rank_states(worker)):
            return True
        os.kill(pid, signal.SIGCONT)  # it began a save in between: try again
        return False
    wait_for(stopped_training, 60, "the rank stopped in a step", launcher.log, interval=0.02)


def argparse_losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"ds_argparse: step \d+/\d+ loss ([\d.]+)", log)]


def test_the_trainer_example_resumes_from_the_copy_its_peer_keeps_when_a_worker_pod_is_replaced(shared_dir):
    """The Trainer example, unchanged, on the chart's default storage: worker 1's pod is deleted once its part of a
    checkpoint is kept on worker 0 (SIGTERM: a preemption; a Trainer saves nothing when stopped) and its replacement
    starts with an empty volume. The peer copy gives it its part of the newest checkpoint both workers hold, any
    newer one is set aside, and every process resumes from that one checkpoint (get_last_checkpoint() takes the
    newest directory on each node's own volume: a mix would resume the two workers at different steps)."""
    with Cluster(render(trainer_values(shared_dir, 200))) as cluster:
        workers = cluster.start_workers()
        launcher = cluster.pods_of("launcher")[0]
        run = cluster.start(launcher)
        wait_for(lambda: re.search(r"checkpoint-\d+: this worker's part", workers[1].log()), 240,
                 "a checkpoint of worker 1's kept on worker 0", lambda: launcher.log() + workers[1].log())
        cluster.signal_main(workers[1].process, signal.SIGTERM)
        assert wait(workers[1].process, timeout=60) == 0, workers[1].log()[-3000:]
        cluster.start(workers[1], log_name="worker1-replacement", new_pod=True)
        code = wait(run, timeout=300)
        log = launcher.log()
    assert code == 0, log[-5000:]
    plan = re.search(r"resuming from (checkpoint-\d+): worker 1 from the copy its peer keeps \(worker 0\)", log)
    assert plan, log[-5000:]
    retry = log[plan.end():]
    resumed = re.findall(r"hf_trainer: resuming from /checkpoints/(checkpoint-\d+) \(process (\d)\)", retry)
    assert sorted(resumed) == [(plan[1], "0"), (plan[1], "1")], retry[-5000:]  # one checkpoint, every process
    print("\n" + "\n".join(line for line in log.splitlines() if "peer-copy" in line or "resuming from" in line))
    assert "hf_trainer: done at global step 200" in retry, retry[-3000:]


def test_a_deepspeed_examples_style_argparse_module_runs(shared_dir):
    values = program_values(shared_dir, module="examples.ds_argparse", argsConvention="deepspeed",
                            args=["--steps=20"])
    with Cluster(render(values)) as cluster:
        code, log = cluster.run_launcher(timeout=240)
        assert code == 0, log[-5000:]
        assert "rank-log.py -m examples.ds_argparse --steps=20 --deepspeed --deepspeed_config " \
               "/etc/deepspeed/config/ds_config.json" in log  # the program's arguments, then the chart's
        assert "world 2 config /etc/deepspeed/config/ds_config.json" in log
        losses = argparse_losses(log)
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        # No --save_dir: the program took the chart's DS_CHECKPOINT_DIR from its env.
        assert (cluster.checkpoint_dir() / "step20").is_dir()


@pytest.mark.parametrize("mode", ["ssh", "nossh"])
def test_a_plain_deepspeed_program_on_per_worker_volumes_resumes_every_rank_from_one_tag(shared_dir, mode):
    """The DeepSpeedExamples-style program, unchanged (it resumes with engine.load_checkpoint from `latest`), on the
    chart's default storage, a volume per worker pod: DeepSpeed writes `latest` on global rank 0 only, so the chart's
    rank wrapper has every node's local rank 0 mark its own after each save (podruntime/savehook.py). A rank of
    worker 1 is killed after a save: the retry resumes every rank from one tag, which every volume names."""
    values = program_values(shared_dir, module="examples.ds_argparse", argsConvention="deepspeed",
                            args=["--steps=600", "--save_every=50"])
    del values["checkpoints"]
    values["launchMode"] = mode
    with Cluster(render(values)) as cluster:
        workers = cluster.pods_of("worker")
        if mode == "ssh":
            cluster.start_workers()
            job = [cluster.start(cluster.pods_of("launcher")[0])]
        else:
            job = [cluster.start(worker) for worker in workers]
        logs = lambda: "".join(pod.log() for pod in cluster.pods)  # noqa: E731
        wait_for(lambda: "ds_argparse: saved /checkpoints/step100" in logs(), 300, "the save at step 100", logs,
                 interval=0.05)
        assert all((cluster.checkpoint_dir(w) / "latest").read_text().startswith("step") for w in workers)
        os.kill(cluster.rank_pids(workers[1], ranks_only=True)[0], signal.SIGKILL)
        codes = [wait(process, timeout=600) for process in job]
        log = logs()
        assert codes == [0] * len(job), log[-5000:]
        resumed = set(re.findall(r"ds_argparse: rank (\d) resumed from /checkpoints/(step\d+)/\S+ at step (\d+)", log))
        assert {rank for rank, _, _ in resumed} == {"0", "1"} and len({r[1:] for r in resumed}) == 1, resumed
        tag = next(iter(resumed))[1]
        assert 100 <= int(tag.removeprefix("step")) < 600, resumed
        assert "ds_argparse: saved /checkpoints/step600" in log
        assert [(cluster.checkpoint_dir(w) / "latest").read_text() for w in workers] == ["step600"] * 2
        print(f"\n{mode}: every rank resumed from {tag}: {sorted(resumed)}")


def test_a_script_gets_the_charts_paths_through_placeholders(shared_dir):
    values = program_values(shared_dir, script=str(ROOT / "examples" / "ds_argparse.py"), argsConvention="none",
                            args=["--deepspeed", "--deepspeed_config={ds_config}", "--save_dir={checkpoint_dir}/run1",
                                  "--steps=10"])
    with Cluster(render(values)) as cluster:
        code, log = cluster.run_launcher(timeout=240)
        assert code == 0, log[-5000:]
        assert f"{ROOT}/examples/ds_argparse.py --deepspeed --deepspeed_config=/etc/deepspeed/config/ds_config.json " \
               "--save_dir=/checkpoints/run1 --steps=10" in log
        assert "ds_argparse: saved /checkpoints/run1/step10" in log
        assert (cluster.checkpoint_dir() / "run1" / "step10").is_dir()


def upload_every_part(s3, gateway: dict, bucket: str, volumes: list, tag: str) -> None:
    """Each worker's part of `tag` sent to the bucket as its sidecar's uploader sends it, node 0 last (it commits
    once every part is there)."""
    for node in (1, 0):
        uploads = s3.upload_round(s3.worker_env(gateway, bucket, volumes[node], node), rounds=2,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = uploads.communicate(timeout=300)
        assert uploads.returncode == 0 and f"uploaded {tag}" in err, out + err
    assert f"committed {tag} in the bucket (2 part(s))" in err, err


def restore_into_fresh_workers(s3, gateway: dict, bucket: str, cluster, tag: str) -> list:
    """The new pods' restore step (objectstore restore, as the pods' user) fills each fresh worker volume with its
    part of `tag` from the bucket; the volumes."""
    volumes = []
    for node, worker in enumerate(cluster.start_workers()):
        volume = cluster.checkpoint_dir(worker)
        assert not any(volume.iterdir()), sorted(volume.iterdir())  # a fresh pod's volume
        restored = s3.run_objectstore("restore", s3.worker_env(gateway, bucket, volume, node), timeout=300,
                                      user=UID)
        assert restored.returncode == 0, restored.stderr
        assert f"restored {tag} from the bucket into {volume / tag} (node {node}'s part" in restored.stdout, \
            restored.stdout
        volumes.append(volume)
    return volumes


@pytest.mark.skipif("objectstore" not in os.environ.get("DS_DRILLS", ""),
                    reason="a long drill: `make drill-objectstore` runs it (DS_DRILLS=objectstore)")
def test_the_trainer_example_resumes_from_the_bucket_in_fresh_pods(shared_dir, tmp_path):
    """The Trainer example on the default storage (a volume per worker pod) with no change to the program: each
    worker's part of its newest checkpoint goes to the bucket (the sidecar's Uploader, per worker, node 0 commits),
    every pod and volume is lost, and the next deployment's pods start with empty volumes, which their restore step
    (files/objectstore.py restore, as the pods' user) fills from the bucket before the ranks start: the Trainer
    resumes from checkpoint-10."""
    from tests.support import s3  # noqa: PLC0415

    if s3.unavailable():
        pytest.skip(s3.unavailable())
    gateway = s3.up()
    bucket = s3.new_bucket(gateway)
    with Cluster(render(trainer_values(shared_dir, 10))) as cluster:
        code, log = cluster.run_launcher(timeout=300)
        assert code == 0, log[-5000:]
        upload_every_part(s3, gateway, bucket, [cluster.checkpoint_dir(w) for w in cluster.pods_of("worker")],
                          "checkpoint-10")
    with Cluster(render(trainer_values(shared_dir, 20))) as cluster:
        restore_into_fresh_workers(s3, gateway, bucket, cluster, "checkpoint-10")
        code = wait(cluster.start(cluster.pods_of("launcher")[0]), timeout=300)
        log = cluster.pods_of("launcher")[0].log()
    assert code == 0, log[-5000:]
    assert "hf_trainer: resuming from /checkpoints/checkpoint-10" in log, log[-5000:]
    assert "hf_trainer: done at global step 20" in log, log[-3000:]
    print("\n| the Trainer example, every pod and volume lost | restored checkpoint-10 from the bucket on both workers "
          "| resumed there, done at global step 20 |")


@pytest.mark.skipif("objectstore" not in os.environ.get("DS_DRILLS", ""),
                    reason="a long drill: `make drill-objectstore` runs it (DS_DRILLS=objectstore)")
def test_a_plain_deepspeed_program_resumes_from_the_bucket_in_fresh_pods(shared_dir):
    """The DeepSpeedExamples-style program, unchanged, on per-worker volumes with the bucket tier: each worker's part
    of the tag its `latest` names goes up (the savehook marks every node's), every pod and volume is lost, the new
    pods' restore steps fetch their parts and every node's `latest`, and every rank resumes from that one tag.
    (CI: tests/test_objectstore.py's own-tags test and the per-worker restore of the train package's tags.)"""
    from tests.support import s3  # noqa: PLC0415

    if s3.unavailable():
        pytest.skip(s3.unavailable())
    gateway = s3.up()
    bucket = s3.new_bucket(gateway)

    def values(steps: int) -> dict:
        found = program_values(shared_dir, module="examples.ds_argparse", argsConvention="deepspeed",
                               args=[f"--steps={steps}", "--save_every=50"])
        del found["checkpoints"]
        return found

    with Cluster(render(values(100))) as cluster:
        code, log = cluster.run_launcher(timeout=300)
        assert code == 0, log[-5000:]
        volumes = [cluster.checkpoint_dir(w) for w in cluster.pods_of("worker")]
        assert [(v / "latest").read_text() for v in volumes] == ["step100"] * 2
        upload_every_part(s3, gateway, bucket, volumes, "step100")
    with Cluster(render(values(150))) as cluster:
        volumes = restore_into_fresh_workers(s3, gateway, bucket, cluster, "step100")
        assert [(v / "latest").read_text() for v in volumes] == ["step100"] * 2
        code = wait(cluster.start(cluster.pods_of("launcher")[0]), timeout=300)
        log = cluster.pods_of("launcher")[0].log()
    assert code == 0, log[-5000:]
    resumed = set(re.findall(r"ds_argparse: rank (\d) resumed from /checkpoints/(step\d+)/\S+ at step (\d+)", log))
    assert resumed == {("0", "step100", "100"), ("1", "step100", "100")}, resumed
    assert "ds_argparse: saved /checkpoints/step150" in log
    print(f"\n| ds_argparse, every pod and volume lost | restored step100 from the bucket on both workers "
          f"| {sorted(resumed)} |")
