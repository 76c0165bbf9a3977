"""The peer copy (checkpoints.peerCopy, podruntime/peercopy.py), side by side with what each compares against, on a
real tag of the train package (2 workers, each its own volume, ZeRO-2, the model below), each worker's keeper on
its own loopback address as each pod has its own:

- copy rate: worker 1's part sent to its keeper (the Replicator, as the worker's agent runs it) vs a plain copy of
  the same files on the same disk (shutil.copytree): the copy's cost per save, and the lag it leaves (the copy lands
  this long after the commit);
- stall: the steps' wall time while the copy runs beside them (a keeper and a sender per worker, copying each new
  tag as it commits) vs the same run without it (goal: none beyond noise; the copy is never in the step loop);
- restore: a new pod's part back from its peer (prepare, as before its ranks start) vs the same part from the bucket
  (the restore container's objectstore restore, on the local RADOS Gateway when ../shared/s3 is there) vs a volume
  that kept it (prepare with nothing to fetch).

    python bench/peercopy.py [--d-model 768 --layers 6 --rounds 2]
"""

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from podruntime import checkpoints, objectstore, peercopy  # noqa: E402
from podruntime.tenantfiles import Tree  # noqa: E402
from tests.support import s3  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.train_run import cpu_ds_config, run_per_worker, write_ds_config  # noqa: E402

RELEASE = "bench/peercopy"


def timed(run) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def part_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


class Ring:
    """Two workers' keepers and senders over loopback, on the given volumes."""

    def __init__(self, dirs: list[Path]):
        port = free_port()
        hosts = ["127.0.0.1", "127.0.0.2"]
        self.rings = [peercopy.Ring(n, hosts, port, RELEASE) for n in range(2)]
        self.volumes = [Tree(d) for d in dirs]
        for volume in self.volumes:
            volume.mkdir()
        self.keepers = [peercopy.Keeper(r, v, socket.create_server((r.hosts[r.node], port)))
                        for r, v in zip(self.rings, self.volumes, strict=True)]
        self.senders = [peercopy.Replicator(r, v) for r, v in zip(self.rings, self.volumes, strict=True)]
        self.stop = threading.Event()

    def run(self) -> None:
        for sender in self.senders:
            threading.Thread(target=sender.run, args=(self.stop,), daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        for keeper in self.keepers:
            keeper.close()


def train(common: list[str], dirs: list[Path], steps: int) -> float:
    seconds, result = timed(lambda: run_per_worker([*common, "--steps", str(steps)], dirs, timeout=3600))
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-3000:])
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return measure(Path(tmp), opts)


def measure(tmp: Path, opts: argparse.Namespace) -> int:
    ds_config = write_ds_config(tmp, cpu_ds_config(stage=2, micro=1, accum=1,
                                                   checkpoint={"use_node_local_storage": True}))
    common = ["--ds-config", str(ds_config), "--checkpoint-every", str(opts.checkpoint_every), "--log-every", "1",
              "--model.n-layer", str(opts.layers), "--model.d-model", str(opts.d_model), "--model.n-head", "16",
              "--model.seq-len", "32"]

    # Stall: the same run with and without a keeper and a sender per worker, alternating; the best of each.
    plain_s, copied_s, copies = [], [], []
    for round_ in range(opts.rounds):
        plain_s.append(train(common, [tmp / f"plain{round_}-0", tmp / f"plain{round_}-1"], opts.steps))
        dirs = [tmp / f"copied{round_}-0", tmp / f"copied{round_}-1"]
        ring = Ring(dirs)
        ring.run()
        copied_s.append(train(common, dirs, opts.steps))
        ring.senders[1].flush(600)
        copies.append(ring.senders[1].status)
        ring.close()
    dirs = [tmp / "copied0-0", tmp / "copied0-1"]
    tag = checkpoints.complete_tags(Tree(dirs[1]))[0]
    part = part_bytes(dirs[1] / tag)

    # Copy rate: worker 1's part to its keeper, vs a plain copy of the same files on the same disk.
    ours, plain = [], []
    for round_ in range(opts.rounds):
        ring = Ring([tmp / f"keeper{round_}", dirs[1]])
        seconds, _ = timed(lambda r=ring: r.senders[1].copy(tag))
        ours.append(part / seconds)
        ring.close()
        seconds, _ = timed(lambda r=round_: shutil.copytree(dirs[1] / tag, tmp / f"plain-copy{r}"))
        plain.append(part / seconds)

    # Restore: a new pod of worker 1 (an empty volume) gets its part back from its keeper, from the bucket, or
    # finds it on its own volume.
    ring = Ring([tmp / "keeper0", tmp / "new-1"])
    peer_s, _ = timed(lambda: peercopy.prepare(ring.rings[1], ring.volumes[1], tag, True))
    ring.close()
    own_ring = Ring([tmp / "own-keeper", dirs[1]])
    own_s, _ = timed(lambda: peercopy.prepare(own_ring.rings[1], own_ring.volumes[1], tag, False))
    own_ring.close()
    bucket_s = restore_from_bucket(dirs, tmp / "bucket-1")

    params = 12 * opts.layers * opts.d_model ** 2 + 2 * 256 * opts.d_model
    lag = statistics.median(c["seconds"] for c in copies if c["seconds"] is not None)
    print(f"model: ~{params / 1e6:.0f}M parameters (ZeRO-2, 2 CPU workers, a save every {opts.checkpoint_every} "
          f"steps); worker 1's part of {tag}: {part / 1e6:,.0f} MB; best of {opts.rounds} alternating rounds")
    print(f"{'measure':<52}{'this chart':>12}{'compared with':>15}{'ratio':>8}  goal")
    print(f"{'copy MB/s (to the peer vs a plain copy, same disk)':<52}{max(ours) / 1e6:>12.1f}"
          f"{max(plain) / 1e6:>15.1f}{max(ours) / max(plain):>7.2f}x  (the copy lands {lag:.1f}s after the commit)")
    print(f"{f'run s, {opts.steps} steps (with the copy vs without)':<52}{min(copied_s):>12.1f}{min(plain_s):>15.1f}"
          f"{min(copied_s) / min(plain_s):>7.2f}x  <= 1.05x (no stall in the step loop)")
    print(f"{'restore s (from the peer vs from the bucket)':<52}{peer_s:>12.2f}"
          + (f"{bucket_s:>15.2f}{peer_s / bucket_s:>7.2f}x" if bucket_s else f"{'(no gateway)':>15}{'':>8}")
          + f"  (own volume: {own_s:.3f}s)")
    print(json.dumps({"part_bytes": part, "copy_Bps": max(ours), "plain_copy_Bps": max(plain), "lag_s": lag,
                      "run_s": min(copied_s), "run_without_s": min(plain_s), "restore_peer_s": peer_s,
                      "restore_bucket_s": bucket_s, "restore_own_s": own_s}))
    return 0


def restore_from_bucket(dirs: list[Path], target: Path) -> float | None:
    """Both workers' parts uploaded and committed, then worker 1's restored into an empty volume: its seconds
    (None without the local gateway)."""
    if s3.unavailable():
        return None
    s3.claim_session()
    gateway = s3.up()
    try:
        bucket = s3.new_bucket(gateway)
        uploaders = [objectstore.Uploader(objectstore.Settings(env=s3.worker_env(gateway, bucket, d, n)))
                     for n, d in enumerate(dirs)]
        for uploader in uploaders:
            uploader.upload_newest()
        uploaders[0].commit_and_prune()
        settings = objectstore.Settings(env=s3.worker_env(gateway, bucket, target, 1))
        seconds, said = timed(lambda: objectstore.restore_checkpoint(s3.client(gateway), settings))
        if "restored" not in said:
            raise RuntimeError(said)
        return seconds
    finally:
        s3.leave()


if __name__ == "__main__":
    sys.exit(main())
