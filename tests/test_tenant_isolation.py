"""Tenants sharing a cluster, a namespace and a checkpoint claim: each release owns its directory on the claim, no
value moves the checkpoints or the ds_config elsewhere, and a rank resumes only its own release's checkpoints.
Cases are generated per class: every chart volume, every chart-owned program option x its argparse forms."""

import json
import subprocess

import pytest

from podruntime import ownership
from tests.support.chart import CHART, HELM, HelmError, container, env_of, one, render_chart
from tests.support.train_run import cpu_ds_config, run_single, write_ds_config
from train import checkpoint, conventions

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")

# ---------------------------------------------------------------- chart: the release's own directory

CLAIM = {"checkpoints": {"existingClaim": "shared"}}
NOSSH = {"launchMode": "nossh"}


def worker(docs):
    return next(d for d in docs if d["kind"] in ("StatefulSet", "Job")
                and d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker")


@pytest.mark.parametrize("mode", [{}, NOSSH], ids=["ssh", "nossh"])
def test_each_release_mounts_only_its_own_directory_of_a_shared_claim(mode):
    seen = set()
    for namespace, release in (("team-a", "run"), ("team-b", "run"), ("team-a", "other")):
        docs = render_chart({**CLAIM, **mode}, release=release, namespace=namespace)
        pod = worker(docs)["spec"]["template"]["spec"]
        mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "checkpoints"]
        assert mounts == [{"name": "checkpoints", "mountPath": "/checkpoints", "subPath": f"{namespace}/{release}"}]
        assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared"}} in pod["volumes"]
        env = env_of(worker(docs))
        assert env["DS_RELEASE"] == f"{namespace}/{release}" and env["DS_CHECKPOINT_DIR"] == "/checkpoints"
        seen.add(mounts[0]["subPath"])
    assert len(seen) == 3


def test_resume_from_mounts_the_other_release_read_only_with_its_name():
    docs = render_chart({"checkpoints": {"existingClaim": "shared", "resumeFrom": "team-a/old"}}, namespace="team-a")
    mounts = [m for m in container(worker(docs))["volumeMounts"] if m["name"] == "checkpoints"]
    assert mounts[1] == {"name": "checkpoints", "mountPath": "/etc/deepspeed/resume-from", "subPath": "team-a/old",
                         "readOnly": True}
    env = env_of(worker(docs))
    assert (env["DS_RESUME_FROM_DIR"], env["DS_RESUME_FROM_RELEASE"]) == ("/etc/deepspeed/resume-from", "team-a/old")
    assert "DS_RESUME_FROM_DIR" not in env_of(worker(render_chart(CLAIM)))


CHART_VOLUMES = ["config", "scripts", "ssh-keys", "home", "tmp", "dshm", "checkpoints", "data"]
REFUSED = {
    **{f"extraVolumeMounts of the chart's {name}": (
        {**CLAIM, "worker": {"extraVolumeMounts": [{"name": name, "mountPath": "/mnt/x"}]}},
        "a volume the chart mounts itself") for name in CHART_VOLUMES},
    "the checkpoint claim as data": ({**CLAIM, "data": {"existingClaim": "shared"}}, "data.existingClaim"),
    "the checkpoint claim as an extra volume, with the opt-in": (
        {**CLAIM, "allowSecurityRelaxations": True, "worker": {"extraVolumes": [
            {"name": "all", "persistentVolumeClaim": {"claimName": "shared"}}]}}, "worker.extraVolumes[0] (all)"),
    **{f"a {kind} extra volume without the opt-in": (
        {"worker": {"extraVolumes": [{"name": "x", kind: spec}]}}, f"worker.extraVolumes[0] (x): {kind} volume")
       for kind, spec in (("persistentVolumeClaim", {"claimName": "other"}), ("csi", {"driver": "nfs.csi.k8s.io"}),
                          ("ephemeral", {"volumeClaimTemplate": {"spec": {}}}))},
    "resumeFrom without a claim": ({"checkpoints": {"resumeFrom": "default/old"}}, "checkpoints.resumeFrom"),
    "resumeFrom of itself": ({"checkpoints": {"existingClaim": "shared", "resumeFrom": "default/job"}},
                             "this release's own directory"),
    "resumeFrom as a path": ({"checkpoints": {"existingClaim": "shared", "resumeFrom": "../../x"}},
                             "/checkpoints/resumeFrom"),
    **{f"train.config.{key}": ({"train": {"config": {key: "/tmp/x"}}}, f"train.config.{key}: set by the chart")
       for key in ("checkpoint_dir", "ds_config")},
}


@pytest.mark.parametrize("case", REFUSED, ids=REFUSED.keys())
def test_values_that_reach_past_the_releases_directory_stop_at_render(case):
    values, message = REFUSED[case]
    with pytest.raises(HelmError) as err:
        render_chart(values)
    assert message in err.value.stderr


def test_a_claim_the_platform_allows_as_an_extra_volume_is_reported_as_a_relaxation():
    docs = render_chart({"allowSecurityRelaxations": True, "worker": {
        "extraVolumes": [{"name": "scratch", "persistentVolumeClaim": {"claimName": "team-scratch"}}],
        "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}})
    relaxed = worker(docs)["spec"]["template"]["metadata"]["annotations"]["deepspeed-training/security-relaxations"]
    assert "worker.extraVolumes[0] (scratch): persistentVolumeClaim volume" in relaxed


# What the chart owns in each convention, as the program's own parser spells it (train/conventions.py reads the real
# parsers: a Trainer takes --output-dir and --ddp-timeout too, every program --local_rank), in every form argparse
# takes as it: exact, =value, and an abbreviation. The examples below must be among them.
OWNED = {convention: conventions.owned_spellings(convention) for convention in conventions.PASSES}
KNOWN_SPELLINGS = {"train": ["--ds-config", "--config", "--checkpoint-dir", "--local_rank"],
                   "huggingface": ["--deepspeed", "--output_dir", "--output-dir", "--ddp_timeout", "--ddp-timeout",
                                   "--local_rank", "--local-rank"],
                   "deepspeed": ["--deepspeed", "--deepspeed_config", "--deepscale_config", "--local_rank"],
                   "none": ["--local_rank", "--local-rank"]}
ARG_CASES = {f"{convention} {arg}": (convention, arg) for convention, options in OWNED.items() for option in options
             for arg in (option, f"{option}=/tmp/x", option[:-2], f"{option[:-3]}=/tmp/x")}


def test_the_owned_spellings_come_from_the_parsers_and_are_what_the_chart_reads():
    for convention, spellings in KNOWN_SPELLINGS.items():
        assert set(spellings) <= set(OWNED[convention]), (convention, OWNED[convention])
    generated = json.loads((CHART / "files" / "generated" / "conventions.json").read_text())["conventions"]
    assert generated == conventions.generated()  # also `scripts/chart_data.py --check` (tests/test_hostile_chart)


@pytest.mark.parametrize("case", ARG_CASES, ids=ARG_CASES.keys())
def test_train_args_cannot_set_what_the_chart_owns_in_any_spelling(case):
    convention, arg = ARG_CASES[case]
    values = {"train": {"argsConvention": convention, "script": "" if convention == "train" else "/app/p.py",
                        "args": ["--steps=10", arg]}}
    with pytest.raises(HelmError) as err:
        render_chart(values)
    assert "train.args[1]" in err.value.stderr and "which the chart owns" in err.value.stderr, err.value.stderr


def test_train_args_may_not_end_the_options():
    with pytest.raises(HelmError, match=r'train.args\[1\]: "--" ends the program'):
        render_chart({"train": {"argsConvention": "huggingface", "script": "/app/p.py", "args": ["--do_train", "--"]}})


def test_train_args_of_the_program_itself_come_first_and_the_charts_options_win_in_its_parser():
    """By construction: the chart's options come after train.args, so the real parser keeps the chart's values
    whatever train.args holds (here options next to the owned ones, and a list option just before the chart's)."""
    docs = render_chart({"train": {"argsConvention": "huggingface", "script": "/app/p.py", "args": [
        "--do_train", "--output_dir_suffix=x", "--deepspeed_plugin=y", "--report_to", "none"]},
        "deepspeed": {"collectiveTimeoutMinutes": 7}})
    args = container(one(docs, "Job"))["args"]
    program = args[args.index("/app/p.py") + 1:]
    assert program[:5] == ["--do_train", "--output_dir_suffix=x", "--deepspeed_plugin=y", "--report_to", "none"]
    hf = conventions.parser("huggingface")
    parsed, unknown = hf.parse_known_args(["--local_rank=0", *program])
    assert (parsed.output_dir, parsed.deepspeed, parsed.ddp_timeout) == (
        "/checkpoints", "/etc/deepspeed/config/ds_config.json", 420)
    assert parsed.report_to == "none" and unknown == ["--output_dir_suffix=x", "--deepspeed_plugin=y"]
    ours = container(one(render_chart({"train": {"args": ["--steps=10", "--log-every=5"]}}), "Job"))["args"]
    parsed = conventions.parser("train").parse_args(["--local_rank=0", *ours[ours.index("train") + 1:]])
    assert (parsed.ds_config, parsed.config, parsed.checkpoint_dir, parsed.steps) == (
        "/etc/deepspeed/config/ds_config.json", "/etc/deepspeed/config/train_config.json", "/checkpoints", 10)


# ---------------------------------------------------------------- train: a rank trusts only its release's checkpoints

def test_a_checkpoint_names_its_release_and_another_release_is_refused(tmp_path):
    manifest = {"release": "team-a/run"}
    checkpoint.check_owner(manifest, tmp_path, "team-a/run")
    checkpoint.check_owner({}, tmp_path, "team-a/run")  # written outside the chart
    checkpoint.check_owner(manifest, tmp_path, "")  # a run outside the chart
    with pytest.raises(checkpoint.CheckpointError, match="belongs to release team-a/run, not to team-b/run"):
        checkpoint.check_owner(manifest, tmp_path, "team-b/run")


def test_where_both_name_a_project_identity_it_decides_and_the_platforms_adoption_is_ours(tmp_path, monkeypatch):
    written = {"release": "team-a/run", "owner": "proj-old"}
    monkeypatch.setenv(ownership.OWNER_ENV, "proj-new")
    with pytest.raises(checkpoint.CheckpointError, match="belongs to project proj-old, not to proj-new"):
        checkpoint.check_owner(written, tmp_path, "team-a/run")  # the same release name, another project
    monkeypatch.setenv(ownership.ADOPT_ENV, "proj-old")
    checkpoint.check_owner(written, tmp_path, "team-a/run")  # the platform adopted it
    monkeypatch.delenv(ownership.ADOPT_ENV)
    checkpoint.check_owner({**written, "owner": "proj-new"}, tmp_path, "team-a/run")  # a reinstall
    checkpoint.check_owner({"release": "team-a/run"}, tmp_path, "team-a/run")  # written before identities
    with pytest.raises(checkpoint.CheckpointError, match="belongs to release team-a/run, not to team-b/run"):
        checkpoint.check_owner({"release": "team-a/run"}, tmp_path, "team-b/run")
    # another release's checkpoints that the platform named (resumeFrom): that release's name decides
    checkpoint.check_owner(written, tmp_path, "team-a/run", own=False)
    with pytest.raises(checkpoint.CheckpointError, match="belongs to release team-a/run, not to team-x/old"):
        checkpoint.check_owner(written, tmp_path, "team-x/old", own=False)


def test_ranks_resume_their_own_release_and_another_only_through_the_platforms_opt_in(tmp_path):
    ds = write_ds_config(tmp_path, cpu_ds_config(stage=1, micro=2))
    model = ["--model.n-layer=1", "--model.d-model=16", "--model.n-head=2", "--model.seq-len=16", "--log-every=1"]
    a, b = tmp_path / "team-a" / "run", tmp_path / "team-b" / "run"

    def train(directory, steps, **env):
        return run_single([f"--ds-config={ds}", f"--checkpoint-dir={directory}", f"--steps={steps}",
                           "--checkpoint-every=2", *model], DS_CHECKPOINT_DIR=str(directory),
                          DS_CONFIG_PATH=str(ds), **env)

    first = train(a, 2, DS_RELEASE="team-a/run", DS_CHECKPOINT_OWNER="proj-a")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert checkpoint.read_manifest(a / "step_00000002")["release"] == "team-a/run"
    assert checkpoint.read_manifest(a / "step_00000002")["owner"] == "proj-a"
    stolen = train(a, 4, DS_RELEASE="team-b/run")  # its directory holds another release's checkpoint
    assert stolen.returncode == 2 and "belongs to release team-a/run, not to team-b/run" in stolen.stdout
    before = {p: p.stat().st_mtime_ns for p in a.rglob("*")}
    opted = train(b, 4, DS_RELEASE="team-b/run", DS_RESUME_FROM_DIR=str(a), DS_RESUME_FROM_RELEASE="team-a/run")
    assert opted.returncode == 0, opted.stdout[-3000:] + opted.stderr[-3000:]
    assert f"resumed from {a / 'step_00000002'} at step 2" in opted.stdout
    assert checkpoint.read_manifest(b / "step_00000004")["release"] == "team-b/run"
    assert {p: p.stat().st_mtime_ns for p in a.rglob("*")} == before  # the source is only read
    wrong = train(tmp_path / "team-c" / "run", 4, DS_RELEASE="team-c/run", DS_RESUME_FROM_DIR=str(a),
                  DS_RESUME_FROM_RELEASE="team-x/old")
    assert wrong.returncode == 2 and "belongs to release team-a/run, not to team-x/old" in wrong.stdout


@pytest.mark.parametrize("key, flag", [("checkpoint_dir", "--checkpoint-dir"), ("ds_config", "--ds-config")])
def test_a_rank_refuses_a_checkpoint_dir_or_ds_config_other_than_the_charts(tmp_path, key, flag):
    ds = write_ds_config(tmp_path, cpu_ds_config(stage=1, micro=2))
    chart = {"DS_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "DS_CONFIG_PATH": str(ds)}
    args = [f"--ds-config={ds}", f"--checkpoint-dir={tmp_path / 'ckpt'}", "--steps=1", f"{flag}=/tmp/elsewhere"]
    proc = run_single(args, **chart)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{key} '/tmp/elsewhere', but the chart's is" in proc.stdout


def test_install_notes_say_that_resume_from_runs_the_source_releases_code():
    proc = subprocess.run([HELM, "install", "job", str(CHART), "--dry-run=client", "--namespace", "team-a", "--set",
                           "image.repository=r/i", "--set", "checkpoints.existingClaim=shared", "--set",
                           "checkpoints.resumeFrom=team-a/old"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    notes = " ".join(proc.stdout.split())
    assert ("WARNING: checkpoints.resumeFrom team-a/old: DeepSpeed loads checkpoints with torch.load(weights_only="
            "False), which runs code stored in them: this release's ranks run the code of release team-a/old") in notes
