"""Teams' own programs through the rendered chart, on network-namespace hosts (see harness.py): a Hugging Face
Trainer script (`huggingface` convention, ds_config full of "auto"), a DeepSpeedExamples-style argparse module
(`deepspeed` convention) and a script whose arguments carry the chart's paths (`none` convention)."""

import json
import re
import subprocess

import pytest

from scripts.jinja_render import render as render_template
from tests.e2e.chart_pods import REASON, e2e_values, render
from tests.e2e.harness import Cluster
from tests.helm_template import ROOT

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


def test_a_hugging_face_trainer_program_trains_checkpoints_and_resumes(shared_dir, tmp_path):
    claim = tmp_path / "claim"
    claim.mkdir(mode=0o777)
    claim.chmod(0o777)

    def attempt(max_steps):
        values = program_values(shared_dir, script=str(ROOT / "examples" / "hf_trainer.py"),
                                argsConvention="huggingface", fillsDsConfigAuto=True,
                                args=[*HF_ARGS, f"--max_steps={max_steps}"])
        values["deepspeed"]["config"] = hf_ds_config()
        with Cluster(render(values)) as cluster:
            subprocess.run(["cp", "-a", f"{claim}/.", str(cluster.checkpoint_dir())], check=True)
            code, log = cluster.run_launcher(timeout=300)
            subprocess.run(["cp", "-a", f"{cluster.checkpoint_dir()}/.", str(claim)], check=True)
            return code, log

    code, log = attempt(10)
    assert code == 0, log[-5000:]
    assert "--deepspeed /etc/deepspeed/config/ds_config.json --output_dir /checkpoints" in log
    assert (claim / "checkpoint-10").is_dir() and (claim / "checkpoint-5").is_dir()
    history = json.loads((claim / "log_history.json").read_text())
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 5 and losses[-1] < losses[0], losses

    # The next attempt (a retry, or a redeploy that asks for more steps) resumes from checkpoint-10.
    code, log = attempt(16)
    assert code == 0, log[-5000:]
    assert "hf_trainer: resuming from /checkpoints/checkpoint-10" in log
    assert "hf_trainer: done at global step 16" in log
    history = json.loads((claim / "log_history.json").read_text())
    assert [e["step"] for e in history if "loss" in e][-3:] == [12, 14, 16]


def argparse_losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"ds_argparse: step \d+/\d+ loss ([\d.]+)", log)]


def test_a_deepspeed_examples_style_argparse_module_runs(shared_dir):
    values = program_values(shared_dir, module="examples.ds_argparse", argsConvention="deepspeed",
                            args=["--steps=20"])
    with Cluster(render(values)) as cluster:
        code, log = cluster.run_launcher(timeout=240)
        assert code == 0, log[-5000:]
        assert "--module examples.ds_argparse --deepspeed --deepspeed_config /etc/deepspeed/config/ds_config.json" \
               in log
        assert "world 2 config /etc/deepspeed/config/ds_config.json" in log
        losses = argparse_losses(log)
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        # No --save_dir: the program took the chart's DS_CHECKPOINT_DIR from its env.
        assert (cluster.checkpoint_dir() / "step20").is_dir()


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
