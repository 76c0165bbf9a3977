"""Per-worker checkpoint volumes (DS_CHECKPOINT_STORAGE=per-worker): two workers of one rank each, each rank with a
directory of its own that the other never sees, as two pods' volumes are; the real DeepSpeed engine on CPU ranks.
The namespace-host drill (tests/e2e/test_hangs.py) runs the same through the chart in both launch modes."""

import shutil

import pytest

from tests.support.train_run import TINY, metrics, run_per_worker
from train import checkpoint


def test_each_worker_commits_the_part_its_volume_holds(trained_on_worker_volumes):
    _, (first, second) = trained_on_worker_volumes
    for rank, directory in enumerate((first, second)):
        manifest = checkpoint.read_manifest(directory / "step_00000016")
        assert manifest["storage"] == checkpoint.PER_WORKER and manifest["world_size"] == 2
        files = set(manifest["files"])
        # Its own optimizer shard only, and the model states every rank loads (use_node_local_storage).
        assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in files, files
        assert f"zero_pp_rank_{1 - rank}_mp_rank_00_optim_states.pt" not in files, files
        assert "mp_rank_00_model_states.pt" in files, files
        assert (directory / "latest").read_text() == "step_00000016"
        assert [t.name for t in checkpoint.tags_newest_first(directory)] == [
            "step_00000016", "step_00000012", "step_00000008"]


def test_a_resume_reads_each_workers_own_volume_and_continues_with_the_same_losses(tmp_path, trained_on_worker_volumes):
    ds_config, reference_dirs = trained_on_worker_volumes
    dirs = [tmp_path / "worker-0", tmp_path / "worker-1"]
    common = ["--ds-config", str(ds_config), "--checkpoint-every", "4", *TINY]
    first = run_per_worker([*common, "--steps", "8"], dirs)
    assert first.returncode == 0, first.stdout[-4000:]
    second = run_per_worker([*common, "--steps", "16"], dirs)
    assert second.returncode == 0, second.stdout[-4000:]
    assert f"resumed from {dirs[0] / 'step_00000008'} at step 8" in second.stdout
    resumed, expected = dict(metrics(dirs[0])["losses"]), dict(metrics(reference_dirs[0])["losses"])
    assert sorted(resumed) == list(range(9, 17))
    for step in range(9, 17):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


def test_a_tag_one_worker_did_not_commit_is_skipped_and_a_lost_volume_stops_the_job(
        tmp_path, trained_on_worker_volumes):
    """A crash between two workers' commits leaves a tag committed on one volume only: no rank resumes from it.
    A worker whose volume is gone (a new pod, a new node) cannot resume its part: the job stops, exit 2, saying
    so, instead of training from step 0 or from a checkpoint only some ranks have."""
    ds_config, reference_dirs = trained_on_worker_volumes
    dirs = [tmp_path / "worker-0", tmp_path / "worker-1"]
    for source, target in zip(reference_dirs, dirs, strict=True):
        shutil.copytree(source, target)
    (dirs[1] / "step_00000016" / checkpoint.COMMIT_FILE).unlink()
    result = run_per_worker(["--ds-config", str(ds_config), "--steps", "14", *TINY], dirs)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"skipping incomplete checkpoint {dirs[0] / 'step_00000016'}" in result.stdout
    assert f"resumed from {dirs[0] / 'step_00000012'} at step 12" in result.stdout
    shutil.rmtree(dirs[1])
    dirs[1].mkdir()
    lost = run_per_worker(["--ds-config", str(ds_config), "--steps", "20", *TINY], dirs)
    assert lost.returncode == 2, lost.stdout[-4000:]
    assert f"checkpoint {dirs[0] / 'step_00000016'} is complete on rank(s) [0] but not on rank(s) [1]: each " \
           "worker keeps its ranks' part on its own volume" in lost.stdout, lost.stdout[-3000:]
    assert "Traceback" not in lost.stdout


def test_what_per_worker_volumes_cannot_hold_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    from train.layout import Layout

    with pytest.raises(checkpoint.CheckpointError, match="model.pipeline_stages 2 with per-worker checkpoint volumes"):
        checkpoint.check_storage({}, Layout(4, 2), checkpoint.PER_WORKER, "ds.json")
    with pytest.raises(checkpoint.CheckpointError, match="zero_optimization.elastic_checkpoint"):
        checkpoint.check_storage({"zero_optimization": {"elastic_checkpoint": True}}, Layout(4), checkpoint.PER_WORKER,
                                 "ds.json")
    checkpoint.check_storage({"zero_optimization": {"elastic_checkpoint": True}}, Layout(4, 2), checkpoint.SHARED, "x")
    monkeypatch.setenv(checkpoint.STORAGE_ENV, checkpoint.PER_WORKER)
    layout = {"world_size": 2, "zero_stage": 2, "pipeline_stages": 1}
    with pytest.raises(checkpoint.CheckpointError, match="per-worker volumes .* each hold their workers' only"):
        checkpoint.cross_layout_load(tmp_path, {**layout, "world_size": 4}, layout, True, False)
    monkeypatch.setenv(checkpoint.STORAGE_ENV, "nfs")
    with pytest.raises(checkpoint.CheckpointError, match="DS_CHECKPOINT_STORAGE='nfs': expected 'shared' or"):
        checkpoint.storage()
