"""Every node's `latest` for a plain DeepSpeed program on per-worker volumes (podruntime/savehook.py): the rank
wrapper runs such a program through the hook only where the chart asks, the program runs as `python SCRIPT` or
`python -m MODULE` would run it, DeepSpeed's real engine module is wrapped when the program imports it, and the mark
is written only where DeepSpeed writes none, never through a link. A real engine's saves and resume:
tests/e2e/test_byo_programs.py (both launch modes)."""

import json
import os
import subprocess
import sys

import pytest

from podruntime import checkpoints, savehook
from podruntime.tenantfiles import Tree
from tests.support.chart import SCRIPTS

NODE_1 = {"LOCAL_RANK": "0", "RANK": "2", savehook.MARK_ENV: "node"}


def test_the_hook_runs_only_for_a_program_the_chart_marks_for_on_per_worker_volumes():
    program = ["-m", "examples.ds_argparse", "--local_rank=0"]
    per_worker = {savehook.MARK_ENV: "node", checkpoints.STORAGE_ENV: checkpoints.PER_WORKER}
    assert savehook.command(program, {}) == [sys.executable, "-u", *program]
    assert savehook.command(program, {**per_worker, checkpoints.STORAGE_ENV: checkpoints.SHARED}) == \
        [sys.executable, "-u", *program]
    hooked = savehook.command(program, per_worker)
    assert hooked == [sys.executable, "-u", str(SCRIPTS / savehook.HOOK_SCRIPT), *program], hooked


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_program_run_through_the_hook_sees_what_python_would_give_it_and_deepspeeds_engine_is_wrapped(tmp_path,
                                                                                                          how):
    """sys.argv, sys.path[0], __name__, its exit status and the image's podruntime (not the chart's copy that loaded
    the hook) as without the hook; DeepSpeedEngine.save_checkpoint wrapped once the program imports DeepSpeed."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "prog.py").write_text(
        "import json, sys, os\n"
        "import podruntime\n"
        "from deepspeed.runtime.engine import DeepSpeedEngine\n"
        "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__,\n"
        "                  'wrapped': getattr(DeepSpeedEngine.save_checkpoint, '_marks_node_latest', False),\n"
        "                  'podruntime': os.path.dirname(podruntime.__file__)}))\n"
        "sys.exit(7)\n")
    program = [str(package / "prog.py"), "--x=1"] if how == "script" else ["-m", "pkg.prog", "--x=1"]
    env = {**os.environ, savehook.MARK_ENV: "node", checkpoints.STORAGE_ENV: checkpoints.PER_WORKER}
    plain = subprocess.run([sys.executable, "-u", *program], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    hooked = subprocess.run(savehook.command(program, env), cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert plain.returncode == hooked.returncode == 7, hooked.stderr[-3000:]
    seen, expected = json.loads(hooked.stdout.splitlines()[-1]), json.loads(plain.stdout.splitlines()[-1])
    assert seen["wrapped"] is True and expected["wrapped"] is False
    for key in ("argv", "path0", "name", "podruntime"):
        assert seen[key] == expected[key], (key, seen, expected)


def test_the_mark_is_written_where_deepspeed_writes_none_naming_a_tag_it_holds_never_through_a_link(tmp_path):
    (tmp_path / "global_step10").mkdir()
    assert not savehook.mark(tmp_path, "global_step10", {**NODE_1, "RANK": "0"})  # DeepSpeed's own
    assert not savehook.mark(tmp_path, "global_step10", {**NODE_1, "LOCAL_RANK": "1"})  # one per node
    assert not savehook.mark(tmp_path, "global_step10", {**NODE_1, savehook.MARK_ENV: ""})
    assert not savehook.mark(tmp_path, "global_step20", NODE_1)  # not a tag this volume holds
    assert not savehook.mark(tmp_path, "../global_step10", NODE_1) and not (tmp_path / "latest").exists()
    assert savehook.mark(tmp_path, "global_step10", NODE_1)
    assert (tmp_path / "latest").read_text() == "global_step10"
    assert checkpoints.complete_tags(Tree(tmp_path)) == ["global_step10"]
    outside = tmp_path / "outside"
    outside.write_text("theirs")
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").symlink_to(outside)  # the program's own link: replaced, never written through
    assert savehook.mark(tmp_path, "global_step10", NODE_1)
    assert outside.read_text() == "theirs" and (tmp_path / "latest").read_text() == "global_step10"
