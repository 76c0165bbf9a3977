"""Checkpoints in a bucket (checkpoints.objectStore), side by side with what each compares against, on the local
RADOS Gateway (../shared/s3, root): a real tag of the train package (2 workers, each its own volume, ZeRO-2, the
model below; >= 100M parameters by default), then

- upload: the sidecar's Uploader putting worker 0's part vs a plain multipart PUT of the same files by the same
  client (minio's put_object, the same part size and parallel parts) to the same gateway (goal >= 0.8x);
- cold resume: every volume lost, the restore containers (both workers at once) download their parts, then the
  ranks resume and train one step, vs the same resume from the volumes that kept the tag (goal <= 2x);
- the stall per save: the seconds the step loop waits for a save in the background (the copy into host memory)
  vs a blocking save (DeepSpeed's write and the fsync), of the same model.

    python bench/objectstore.py [--d-model 1024 --layers 8]

Set MEMSTORE_BYTES (the gateway keeps objects in memory, 2 GiB by default) above twice a worker's part if this
starts the gateway.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podruntime import objectstore  # noqa: E402
from tests.support import s3  # noqa: E402
from tests.support.train_run import cpu_ds_config, run_per_worker, write_ds_config  # noqa: E402
from train import checkpoint  # noqa: E402


def timed(run) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def trained(args: list[str], dirs: list[Path]) -> str:
    result = run_per_worker(args, dirs, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-3000:])
    return result.stdout


def plain_put(store, bucket: str, tag_dir: Path) -> int:
    sent = 0
    for path in sorted(p for p in tag_dir.rglob("*") if p.is_file()):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            store.put_object(bucket, f"plain/{path.relative_to(tag_dir)}", f, length=size,
                             part_size=objectstore.PART_SIZE, num_parallel_uploads=objectstore.PARALLEL)
        sent += size
    return sent


def restore_both(gateway: dict, bucket: str, dirs: list[Path]) -> None:
    """Both workers' restore containers at once, as the pods run them (python3 -I <scripts> objectstore restore)."""
    procs = [subprocess.Popen(s3.objectstore_argv("restore"),
                              env={"PATH": os.environ["PATH"], **s3.worker_env(gateway, bucket, d, n)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n, d in enumerate(dirs)]
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    if s3.unavailable():
        print(f"skipped: {s3.unavailable()}")
        return 0
    s3.claim_session()
    gateway = s3.up()
    try:
        return measure(gateway, opts)
    finally:
        s3.leave()


def measure(gateway: dict, opts: argparse.Namespace) -> int:
    store = s3.client(gateway)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ds_config = write_ds_config(tmp, cpu_ds_config(stage=2, micro=1, accum=1,
                                                       checkpoint={"use_node_local_storage": True}))
        common = ["--ds-config", str(ds_config), "--checkpoint-every", "2", "--log-every", "1",
                  "--model.n-layer", str(opts.layers), "--model.d-model", str(opts.d_model),
                  "--model.n-head", "16", "--model.seq-len", str(opts.seq_len)]
        # The save at step 2 is the one measured (the last step's save waits for its write in both modes).
        blocking = trained([*common, "--steps", "4", "--checkpoint-background", "false"],
                           [tmp / "blocking-0", tmp / "blocking-1"])
        blocking_s = float(re.search(r"saved checkpoint step_00000002 in ([\d.]+)s\n", blocking)[1])
        dirs = [tmp / "worker-0", tmp / "worker-1"]
        background = trained([*common, "--steps", "4"], dirs)
        written = re.search(r"saved checkpoint step_00000002 in ([\d.]+)s in the background .* the steps waited "
                            r"([\d.]+)s\)", background)
        write_s, stall_s = float(written[1]), float(written[2])
        tag = checkpoint.tag_for(4)
        part = sum(p.stat().st_size for p in (dirs[0] / tag).rglob("*") if p.is_file())
        whole = part + sum(p.stat().st_size for p in (dirs[1] / tag).rglob("*") if p.is_file())

        # Alternating rounds, each into a fresh bucket (a gateway's first writes are slower): the best of each.
        plain, ours = [], []
        for _ in range(opts.rounds):
            bucket = s3.new_bucket(gateway)
            seconds, sent = timed(lambda b=bucket: plain_put(store, b, dirs[0] / tag))
            plain.append(sent / seconds)
            empty(store, bucket)
            bucket = s3.new_bucket(gateway)
            uploader = objectstore.Uploader(objectstore.Settings(env=s3.worker_env(gateway, bucket, dirs[0], 0)))
            seconds, _ = timed(uploader.upload_newest)
            ours.append(part / seconds)
            empty(store, bucket)
        bucket = s3.new_bucket(gateway)
        uploaders = [objectstore.Uploader(objectstore.Settings(env=s3.worker_env(gateway, bucket, d, n)))
                     for n, d in enumerate(dirs)]
        for uploader in uploaders:
            uploader.upload_newest()
        uploaders[0].commit_and_prune()
        if uploaders[0].status["committed_step"] != 4:
            raise RuntimeError(f"step 4 not committed in the bucket: {uploaders[0].status}")

        claim_s, _ = timed(lambda: trained([*common, "--steps", "5"], dirs))
        fresh = [tmp / "new-0", tmp / "new-1"]
        restore_s, _ = timed(lambda: restore_both(gateway, bucket, fresh))
        cold_s, _ = timed(lambda: trained([*common, "--steps", "5"], fresh))
        empty(store, bucket)

    params = 12 * opts.layers * opts.d_model ** 2 + 2 * 256 * opts.d_model
    print(f"model: ~{params / 1e6:.0f}M parameters (ZeRO-2, 2 CPU workers); tag {whole / 1e6:,.0f} MB, worker 0's "
          f"part {part / 1e6:,.0f} MB; upload: best of {opts.rounds} alternating rounds")
    print(f"{'measure':<46}{'this chart':>12}{'compared with':>15}{'ratio':>8}  goal")
    print(f"{'stall per save s (background vs blocking)':<46}{stall_s:>12.2f}{blocking_s:>15.2f}"
          f"{stall_s / blocking_s:>7.2f}x  (background write took {write_s:.1f}s)")
    print(f"{'upload MB/s (Uploader vs plain multipart PUT)':<46}{max(ours) / 1e6:>12.1f}{max(plain) / 1e6:>15.1f}"
          f"{max(ours) / max(plain):>7.2f}x  >= 0.8x")
    print(f"{'cold resume s (restore + resume vs claim)':<46}{restore_s + cold_s:>12.1f}{claim_s:>15.1f}"
          f"{(restore_s + cold_s) / claim_s:>7.2f}x  <= 2x (restore containers {restore_s:.1f}s)")
    return 0


def empty(store, bucket: str) -> None:
    from minio.deleteobjects import DeleteObject

    for error in store.remove_objects(bucket, (DeleteObject(o.object_name) for o in
                                               store.list_objects(bucket, recursive=True))):
        raise RuntimeError(f"deleting from {bucket}: {error}")
    store.remove_bucket(bucket)


if __name__ == "__main__":
    sys.exit(main())
