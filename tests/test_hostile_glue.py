"""Hostile and malformed values layers through the glue (`make deploy ... DRY_RUN=1`, in-process): every one
stops before `helm upgrade` is even printed, in one line naming the file and the key. Legitimate inputs that
look odd (null, quoted numbers, aliases) are accepted with their meaning intact."""

import json
import re
import subprocess

import pytest

from scripts import deployctl
from scripts.jinja_render import render as render_template
from tests.support.chart import HELM, ROOT
from tests.support.glue_tree import run, set_key, write
from tests.support.payloads import ALIAS_BOMB
from train import dsconfig

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")

EXAMPLE = "values/projects/example/values.yaml"
DEV = ["--env", "dev"]
DEV_EXAMPLE = ["--env", "dev", "--project", "example"]


def raw(rel, data: bytes):
    return lambda tree: (tree / rel).write_bytes(data)


def append(rel, text):
    return lambda tree: (tree / rel).write_text((tree / rel).read_text() + text)


def copy_project(name, release=None):
    def make(tree):
        target = tree / "values" / "projects" / name
        target.mkdir()
        text = (tree / EXAMPLE).read_text()
        (target / "values.yaml").write_text(text + (f"deploy:\n  release: {release}\n" if release else ""))
    return make


# (what breaks the tree, deployctl arguments, substrings of the one-line error: the file and the key)
BAD = {
    # unreadable files
    "binary values file": (raw("values/dev.yaml", b"\x00\x01\xff\xfe binary"), DEV, ["values/dev.yaml", "byte"]),
    "latin-1 values file": (raw("values/dev.yaml", "deploy:\n  namespace: caf\xe9\n".encode("latin-1")), DEV,
                            ["values/dev.yaml: byte", "not UTF-8"]),
    "control character": (raw("values/dev.yaml", b"deploy:\n  namespace: a\x07b\n"), DEV, ["values/dev.yaml"]),
    "NUL in a project file": (raw(EXAMPLE, b"chart: {}\x00\n"), DEV_EXAMPLE, [EXAMPLE]),
    "duplicate top-level key": (append("values/dev.yaml", "deploy:\n  namespace: other\n"), DEV,
                                ["values/dev.yaml:", "duplicate key 'deploy'"]),
    "duplicate nested key": (write(EXAMPLE, "chart:\n  worker:\n    replicas: 1\n    replicas: 2\n"), DEV_EXAMPLE,
                             [f"{EXAMPLE}:4:5", "duplicate key 'replicas'"]),
    "alias bomb": (write(EXAMPLE, ALIAS_BOMB), DEV_EXAMPLE, [EXAMPLE, "expands to more than"]),
    "nested too deeply": (write(EXAMPLE, "a: " + "[" * 200 + "]" * 200 + "\n"), DEV_EXAMPLE, [EXAMPLE]),
    "YAML syntax": (write(EXAMPLE, "chart:\n  worker: {replicas: 2\n"), DEV_EXAMPLE, [EXAMPLE, "YAML syntax error"]),
    "top level is a string": (write(EXAMPLE, "just text\n"), DEV_EXAMPLE, [EXAMPLE, "expected a mapping"]),
    "values file is a directory": (lambda tree: ((tree / EXAMPLE).unlink(), (tree / EXAMPLE).mkdir()), DEV_EXAMPLE,
                                   [EXAMPLE, "cannot read"]),
    "boolean key (YAML 1.1 on:)": (write(EXAMPLE, "chart:\n  worker:\n    on: 2\n"), DEV_EXAMPLE,
                                   [f"{EXAMPLE}:3:5", "'on'", "quote it"]),
    "numeric key": (write(EXAMPLE, "deploy:\n  1: x\n"), DEV_EXAMPLE, [f"{EXAMPLE}:2:3", "'1'"]),
    "a link out of values/": (lambda tree: ((tree / EXAMPLE).unlink(), (tree / EXAMPLE).symlink_to("/etc/hostname")),
                              DEV_EXAMPLE, [EXAMPLE, "links outside values/"]),
    "huge values file": (write(EXAMPLE, "# " + "x" * 5_000_000 + "\n"), DEV_EXAMPLE, [EXAMPLE, "bytes"]),
    # platform-only keys and isolation between projects
    "project empties the prod allow-list": (set_key("projects/example/values.yaml", "deploy", "kubeContexts", []),
                                            ["--env", "prod", "--project", "example"],
                                            [EXAMPLE, "deploy.kubeContexts"]),
    "project grants itself relaxed security": (set_key("projects/example/values.yaml", "chart",
                                                       "allowSecurityRelaxations", True), DEV_EXAMPLE,
                                               [EXAMPLE, "chart.allowSecurityRelaxations", "platform"]),
    "project lists itself for relaxed security": (set_key("projects/example/values.yaml", "deploy",
                                                          "relaxSecurityFor", ["example"]), DEV_EXAMPLE,
                                                  [EXAMPLE, "deploy.relaxSecurityFor"]),
    "project picks another ServiceAccount": (set_key("projects/example/values.yaml", "chart", "serviceAccount",
                                                     {"create": False, "name": "platform-deployer"}), DEV_EXAMPLE,
                                             [EXAMPLE, "chart.serviceAccount"]),
    "platform namespace under kube-": (set_key("dev.yaml", "deploy", "namespace", "kube-system"), DEV,
                                       ["values/dev.yaml", "deploy.namespace"]),
    "date where text was meant": (write(EXAMPLE, "chart:\n  train:\n    config:\n      started: 2024-01-01\n"),
                                  DEV_EXAMPLE, [EXAMPLE, "chart.train.config.started", "quote it"]),
    "infinite learning rate": (write(EXAMPLE, "deepspeed:\n  lr: .inf\n"), DEV_EXAMPLE,
                               [EXAMPLE, "deepspeed.lr", "finite"]),
    "timeout with a trailing newline": (set_key("prod.yaml", "deploy", "timeout", "10m\n"), ["--env", "prod"],
                                        ["values/prod.yaml", "deploy.timeout"]),
    "CPU-less fused optimizer on CPU ranks": (set_key("dev.yaml", "deepspeed", "overrides", {
        "optimizer": {"type": "Lamb", "params": {"lr": 0.001, "torch_adam": None}},
        "zero_allow_untested_optimizer": True}), DEV,
        ["values/dev.yaml", "Lamb", "CPU"]),
    "required chart value removed": (set_key("projects/example/values.yaml", "chart", "train", "config", None),
                                     ["--env", "prod", "--project", "example"], [EXAMPLE, "config"]),
    "project widens the allow-list": (set_key("projects/example/values.yaml", "deploy", "kubeContexts", ["any"]),
                                      DEV_EXAMPLE, [EXAMPLE, "deploy.kubeContexts"]),
    "copied project keeps a release": (copy_project("team-b", release="example"), ["--env", "dev", "--project",
                                                                                     "team-b"],
                                       ["values/projects/team-b/values.yaml", "deploy.release", "platform"]),
    "project named after another's objects": (copy_project("example-deepspeed-training"),
                                              ["--env", "dev", "--project", "example-deepspeed-training"],
                                              ["values/projects/example-deepspeed-training/", "project example ",
                                               "would both create", "ml-dev/example-deepspeed-training-"]),
    "the other project of the pair": (copy_project("example-deepspeed-training"), DEV_EXAMPLE,
                                      ["project example ", "project example-deepspeed-training ",
                                       "ml-dev/example-deepspeed-training-"]),
    "project named after another's hook": (  # its ServiceAccount is example's config-check hook's account
        copy_project("example-deepspeed-training-config-check"),
        ["--env", "dev", "--project", "example-deepspeed-training-config-check"],
        ["values/projects/example-deepspeed-training-config-check/", "project example ",
         "ServiceAccount ml-dev/example-deepspeed-training-config-check"]),
    "fullnameOverride takes another project's names": (
        set_key("projects/example/values.yaml", "chart", "fullnameOverride", "hf-example-deepspeed-training"),
        DEV_EXAMPLE, [EXAMPLE, "project hf-example ", "ml-dev/hf-example-deepspeed-training-"]),
    "project names a release of its own": (set_key("projects/example/values.yaml", "deploy", "release",
                                                   "kube-prometheus-stack"), DEV_EXAMPLE, [EXAMPLE, "deploy.release"]),
    "project picks its namespace": (set_key("projects/example/values.yaml", "deploy", "namespace", "monitoring"),
                                    DEV_EXAMPLE, [EXAMPLE, "deploy.namespace", "platform"]),
    "environment gives every project one release": (set_key("dev.yaml", "deploy", "release", "shared"), DEV_EXAMPLE,
                                                    ["deploy.release 'shared'", "values/projects/"]),
    "null on a required setting": (set_key("dev.yaml", "deploy", "namespace", None), DEV,
                                   ["values/dev.yaml", "namespace"]),
    # types and patterns (YAML 1.1 reads 3e-4 as a string)
    "lr without a dot": (write(EXAMPLE, "deepspeed:\n  lr: 3e-4\n"), DEV_EXAMPLE, [EXAMPLE, "deepspeed.lr"]),
    "namespace with a space": (set_key("dev.yaml", "deploy", "namespace", "ml dev"), DEV,
                               ["values/dev.yaml", "deploy.namespace"]),
    "timeout in words": (set_key("prod.yaml", "deploy", "timeout", "ten minutes"), ["--env", "prod"],
                         ["values/prod.yaml", "deploy.timeout"]),
    "zero micro batch": (set_key("dev.yaml", "deepspeed", "microBatch", 0), DEV, ["values/dev.yaml",
                                                                                    "deepspeed.microBatch"]),
    "claim name with a document": (set_key("projects/example/values.yaml", "chart", "checkpoints", "existingClaim",
                                           "x\n---\nkind: ClusterRoleBinding"), DEV_EXAMPLE,
                                   [EXAMPLE, "chart.checkpoints.existingClaim"]),
    "label spoofing another release": (set_key("projects/example/values.yaml", "chart", "worker", "podLabels",
                                               {"app.kubernetes.io/instance": "other"}), DEV_EXAMPLE,
                                       [EXAMPLE, "worker.podLabels", "app.kubernetes.io/instance"]),
    "runner flag pasted into the remote shell": (set_key("projects/example/values.yaml", "chart", "deepspeed",
                                                         "runnerArgs", ["--venv_script=/tmp/x"]), DEV_EXAMPLE,
                                                 [EXAMPLE, "runnerArgs"]),
    "privileged without the opt-in": (set_key("projects/example/values.yaml", "chart", "securityContext",
                                              {"privileged": True}), DEV_EXAMPLE,
                                      [EXAMPLE, "securityContext.privileged", "allowSecurityRelaxations"]),
    "secret as a plain env value": (set_key("projects/example/values.yaml", "chart", "env",
                                            [{"name": "HF_TOKEN", "value": "hf_x"}]), DEV_EXAMPLE,
                                    [EXAMPLE, "HF_TOKEN", "valueFrom"]),
    "env value with a Unicode line separator": (set_key("projects/example/values.yaml", "chart", "env", [
        {"name": "OMP_NUM_THREADS", "value": "1\u2028kind: Secret\u2028metadata: {name: stolen}"}]), DEV_EXAMPLE,
        [EXAMPLE, "env[0] (OMP_NUM_THREADS)"]),
    "two volumes at one path": (set_key("projects/example/values.yaml", "chart", "data", "mountPath", "/checkpoints"),
                                ["--env", "prod", "--project", "example"], [EXAMPLE, "data.mountPath"]),
    # the ds_config the preset and overrides make
    "optimizer typo": (set_key("dev.yaml", "deepspeed", "overrides", {"optimizer": {"type": "AdamWW", "params": {}}}),
                       DEV, ["deepspeed.overrides from values/dev.yaml", "optimizer.type 'AdamWW'", "'AdamW'"]),
    "optimizer param unknown to its constructor": (
        set_key("dev.yaml", "deepspeed", "overrides", {"optimizer": {"params": {"beta1": 0.9}}}), DEV,
        ["values/dev.yaml", "optimizer.params.beta1"]),
    "optimizer param of the wrong type": (
        set_key("dev.yaml", "deepspeed", "overrides", {"optimizer": {"params": {"weight_decay": "0.1"}}}), DEV,
        ["values/dev.yaml", "optimizer.params.weight_decay must be a number"]),
    "scheduler typo": (set_key("dev.yaml", "deepspeed", "overrides", {"scheduler": {"type": "WarmupCosine"}}), DEV,
                       ["values/dev.yaml", "scheduler.type 'WarmupCosine'"]),
    "scheduler param unknown": (set_key("dev.yaml", "deepspeed", "overrides", {"scheduler": {"params": {
        "warmup_steps": 5}}}), DEV, ["values/dev.yaml", "scheduler.params.warmup_steps"]),
    "steps_per_print 0": (set_key("dev.yaml", "deepspeed", "overrides", {"steps_per_print": 0}), DEV,
                          ["values/dev.yaml", "steps_per_print"]),
    "comms logger": (set_key("dev.yaml", "deepspeed", "overrides", {"comms_logger": {"enabled": True}}), DEV,
                     ["values/dev.yaml", "comms_logger"]),
    "NVMe offload without a path": (set_key("dev.yaml", "deepspeed", "overrides", {"zero_optimization": {
        "offload_optimizer": {"device": "nvme"}}}), DEV, ["values/dev.yaml", "offload_optimizer.nvme_path"]),
    "monitor the image lacks": (set_key("dev.yaml", "deepspeed", "overrides", {"wandb": {"enabled": True}}), DEV,
                                ["values/dev.yaml", "wandb.enabled", "'wandb'"]),
    "NaN in an override": (write("values/dev.yaml", (ROOT / "values/dev.yaml").read_text().replace(
        "  lr: 3.0e-3\n", "  lr: 3.0e-3\n  overrides:\n    gradient_clipping: .nan\n")), DEV,
        ["values/dev.yaml", "deepspeed.overrides.gradient_clipping", "finite"]),
    "auto without a program that fills it": (set_key("dev.yaml", "deepspeed", "overrides", {
        "gradient_clipping": "auto"}), DEV, ["values/dev.yaml", "gradient_clipping", "fillsDsConfigAuto"]),
    "train config step count as text": (set_key("dev.yaml", "chart", "train", "config", "steps", "40"), DEV,
                                        ["values/dev.yaml", "steps"]),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_bad_layers_stop_before_anything_is_applied_naming_file_and_key(tree, capsys, case):
    breaks, args, expected = BAD[case]
    breaks(tree)
    code, out, err = run("deploy", *args, "--dry-run", capsys=capsys)
    assert code == 1, out
    assert "helm upgrade" not in out and "Traceback" not in err
    line = err.strip()
    assert "\n" not in line, f"not one line:\n{err}"
    for text in expected:
        assert text in line, line


@pytest.mark.parametrize("env_value", ["dev; touch /tmp/pwned", "$(touch /tmp/pwned)", "../../etc", "Dev"])
def test_make_refuses_env_and_project_that_name_no_directory_without_running_them(tmp_path, env_value):
    marker = tmp_path / "pwned"
    value = env_value.replace("/tmp/pwned", str(marker))
    for variable in ("ENV", "PROJECT"):
        args = ["make", "render", f"{variable}={value}"] + (["ENV=dev"] if variable == "PROJECT" else [])
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and f"{variable} '{value}': not a" in proc.stderr, proc.stderr
    assert not marker.exists()


def test_a_kube_context_from_ci_never_reaches_a_shell(tmp_path):
    marker = tmp_path / "pwned"
    proc = subprocess.run(["make", "plan", "ENV=dev", f"KUBE_CONTEXT=x';touch {marker};'", "PROJECT=example"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


# ---- legitimate inputs that look odd keep their meaning

def test_null_removes_an_inherited_key_as_helm_does(tree, capsys):
    set_key("projects/example/values.yaml", "chart", "worker", "resources", None)(tree)
    set_key("projects/example/values.yaml", "chart", "podSecurityContext", "fsGroupChangePolicy", None)(tree)
    r = deployctl.build("dev", "example")
    assert "resources" not in r.effective["worker"] or r.effective["worker"]["resources"] == {}
    deployctl.write(r)
    values = json.loads("".join(line for line in (r.out / "values.yaml").read_text().splitlines(keepends=True)
                                if not line.startswith("#")))
    assert values["podSecurityContext"]["fsGroupChangePolicy"] is None  # so Helm drops the chart default too
    code, out, _ = run("template", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0 and "fsGroupChangePolicy" not in out


def test_rendered_values_keep_their_types_for_helm(tree, capsys):
    set_key("projects/example/values.yaml", "chart", "image", "tag", "0370e25")(tree)
    set_key("projects/example/values.yaml", "chart", "worker", "podLabels", {"canary": "y", "git": "0370e25"})(tree)
    code, out, err = run("template", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert 'image: "registry.example.com/ml/deepspeed-train:0370e25"' in out
    assert 'canary: "y"' in out or "canary: 'y'" in out or 'canary: y' not in out


def test_aliases_and_merge_keys_within_bounds_are_fine(tree, capsys):
    write(EXAMPLE, "base: &base {n_layer: 2, n_head: 4, d_model: 64, seq_len: 64}\n"
          "chart:\n  train:\n    config:\n      model:\n        <<: *base\n        n_layer: 3\n")(tree)
    with pytest.raises(deployctl.DeployError, match="base"):  # an unknown settings key, named: not a crash
        deployctl.build("dev", "example")
    write(EXAMPLE, "chart:\n  train:\n    config:\n      model: &m {n_layer: 2, n_head: 4, d_model: 64, seq_len: 64}"
          "\n")(tree)
    assert deployctl.build("dev", "example").effective["train"]["config"]["model"]["n_layer"] == 2


def test_relaxations_with_the_opt_in_are_listed_by_plan_and_dry_run(tree, capsys):
    set_key("dev.yaml", "deploy", "relaxSecurityFor", ["example"])(tree)  # the platform's per-project opt-in
    set_key("projects/example/values.yaml", "chart", "networkPolicy", {"enabled": False})(tree)
    set_key("projects/example/values.yaml", "chart", "securityContext", {"readOnlyRootFilesystem": False})(tree)
    for command in (["plan"], ["deploy", "--dry-run"]):
        code, out, err = run(*command, *DEV_EXAMPLE, capsys=capsys)
        assert code == 0, err
        warnings = [line for line in out.splitlines() if "WARNING: security relaxed" in line]
        assert len(warnings) == 2, out
        assert any("networkPolicy.enabled: false" in w for w in warnings)
        assert any("readOnlyRootFilesystem" in w for w in warnings)
    code, out, _ = run("plan", *DEV_EXAMPLE[:2], capsys=capsys)
    assert "WARNING: security relaxed" not in out


def test_the_platform_can_give_a_project_its_own_namespace(tree, capsys):
    set_key("dev.yaml", "deploy", "projectNamespaces", {"example": "team-example"})(tree)
    code, out, err = run("plan", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert "release     example in namespace team-example" in out


def test_null_in_overrides_removes_a_preset_key(tree, capsys):
    set_key("dev.yaml", "deepspeed", "overrides", {"scheduler": None})(tree)
    assert "scheduler" not in deployctl.build("dev", None).ds_config


def test_a_copied_project_deploys_as_its_own_release(tree, capsys):
    copy_project("team-b")(tree)
    code, out, err = run("deploy", "--env", "dev", "--project", "team-b", "--dry-run", capsys=capsys)
    assert code == 0, err
    assert "release     team-b in namespace ml-dev" in out


def test_a_project_whose_name_extends_anothers_deploys_beside_it(tree, capsys):
    """`example` and `example-7b` (llama and llama-7b): one name starts the other, their objects' names do not
    meet; each deploys, in the same namespace."""
    copy_project("example-7b")(tree)
    for project in ("example-7b", "example"):
        code, out, err = run("deploy", "--env", "dev", "--project", project, "--dry-run", capsys=capsys)
        assert code == 0, err
        assert f"release     {project} in namespace ml-dev" in out


PRESETS = sorted(p.name.removesuffix(".json.j2") for p in (ROOT / "templates" / "ds_config").glob("[!_]*.json.j2"))
PROJECTS = [None] + sorted(p.name for p in (ROOT / "values" / "projects").iterdir() if p.is_dir())


def preset_fills_in_auto(preset: str) -> bool:
    rendered = render_template(ROOT / "templates", f"ds_config/{preset}.json.j2", {
        "micro_batch": 1, "gradient_accumulation": 1, "global_batch": 1, "lr": 1.0, "weight_decay": 0.0,
        "warmup_steps": 1, "gradient_clipping": 1.0, "steps": 10})
    return bool(dsconfig.auto_keys(json.loads(rendered)))


@pytest.mark.parametrize("project", PROJECTS, ids=[str(p) for p in PROJECTS])
@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
@pytest.mark.parametrize("preset", PRESETS)
def test_plan_and_dry_run_for_every_preset_env_and_project(tree, capsys, preset, env, project):
    """Every shipped preset in every environment and project; a preset of "auto" values only where the
    project's program fills them in."""
    layer = f"projects/{project}/values.yaml" if project else f"{env}.yaml"
    set_key(layer, "deepspeed", "preset", preset)(tree)
    args = ["--env", env] + (["--project", project] if project else [])
    code, out, err = run("plan", *args, capsys=capsys)
    fills_auto = project and deployctl.build(env, project).effective["train"]["fillsDsConfigAuto"] if code == 0 \
        else False
    if preset_fills_in_auto(preset) and not fills_auto:
        assert code == 1 and "fillsDsConfigAuto" in err, out + err
        return
    assert code == 0, err
    assert f"preset {preset}: ZeRO stage" in out
    if preset_fills_in_auto(preset):
        assert "batch       micro auto (filled by the program) x accumulation auto" in out
    if project:
        code, out, err = run("deploy", *args, "--dry-run", capsys=capsys)
        assert code == 0, err
        assert "DRY_RUN: not applied" in out and "helm upgrade --install" in out


def test_a_hugging_face_project_plans_its_own_program(capsys):
    code, out, err = run("plan", "--env", "dev", "--project", "hf-example", capsys=capsys)
    assert code == 0, err
    assert "program     /opt/deepspeed-examples/hf_trainer.py (huggingface arguments, fills the ds_config's " \
           "\"auto\" values)" in out
    assert "model       the program's own (no estimate)" in out


def test_a_hugging_face_model_config_read_in_the_pods_does_not_block_the_plan(tree, capsys):
    set_key("projects/example/values.yaml", "chart", "train", "config", "model", "hf_config", "/data/hf/gpt2")(tree)
    code, out, err = run("plan", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert "model.hf_config): no estimate here" in out


def test_fp16_on_cpu_ranks_is_a_plan_warning_whatever_this_machines_cpu(tree, capsys):
    """The glue runs on a deploy machine: its CPU says nothing of the workers'. The ranks check their own."""
    set_key("dev.yaml", "deepspeed", "overrides", {"fp16": {"enabled": True}})(tree)
    code, out, err = run("plan", *DEV, capsys=capsys)
    assert code == 0, err
    assert "WARNING: fp16.enabled on CPU ranks" in out and "values/dev.yaml" in out and "avx512_fp16" in out


HOSTILE_FIELDS = {"summary": "training \x1b[2J\x1b]0;owned\x07 | step 1",
                  "reason": "\x1b]52;c;cm0gLXJmIH4K\x07 paste me", "run": "run-1\u202eexe.txt", "loss": "0.5\x9b31m",
                  "goodput": "g" * 2_000_000, "step": "1\r\nstate: done",
                  "state": "done\u2028forged"}


def test_status_prints_nothing_raw_from_the_cluster():
    """A field holding terminal escapes (clear screen, window title, OSC 52 clipboard), a bidirectional override,
    a line break or a megabyte reaches whoever runs `make status` as one bounded, plain line."""
    text = deployctl.progress_text(HOSTILE_FIELDS)
    assert len(text) < 4000 and len(text.splitlines()) == 1 + len(HOSTILE_FIELDS) - 1
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]", text), repr(text)
    assert "step 1" in text and "paste me" in text and "run-1?exe.txt" in text
    legit = deployctl.progress_text({"summary": "training | step 120/300 (40.0%) | loss 0.4064", "step": "120"})
    assert legit == "training | step 120/300 (40.0%) | loss 0.4064\n  step             120"
