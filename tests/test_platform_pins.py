"""A project's layers cannot undo what the platform's layers pinned, by any path: every platform-only key x every
ancestor set to null and rebuilt, and every pinned field of the rendered pods (identity, scheduling, checkpoint
volume) x every key that feeds it; the platform lists what projects may choose."""

import copy
import json

import pytest

from scripts import deployctl
from tests.support.chart import HELM
from tests.support.glue_tree import run, set_key

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary; run `make setup`")

PROJECT = "values/projects/example/"
DEV_EXAMPLE = ["--env", "dev", "--project", "example"]

# ---------------------------------------------------------------- glue: platform-only keys, by any path

# A value the platform's dev.yaml sets for each platform-only key, so that dropping it is a change.
PLATFORM_VALUES = {
    ("deploy", "kubeContexts"): ["dev-cluster"],
    ("deploy", "namespace"): "ml-dev",
    ("deploy", "projectNamespaces"): {"other": "team-other"},
    ("deploy", "release"): "",
    ("deploy", "relaxSecurityFor"): ["other"],
    ("chart", "allowSecurityRelaxations"): True,
    ("chart", "serviceAccount"): {"create": True, "annotations": {"iam.gke.io/gcp-service-account": "t@p.iam"}},
    ("chart", "checkpoints", "resumeAcrossWorldSizes"): False,
    ("chart", "checkpoints", "resumeFrom"): "ml-dev/old",
    ("chart", "checkpoints", "objectStore"): {"bucket": "ml-checkpoints", "endpoint": "https://s3.example.com",
                                              "credentialsSecret": "ml-checkpoints-s3"},
    ("deploy", "projectResumeFrom"): {"other": "ml-dev/old"},
    ("deploy", "projectIds"): {"other": "p-other"},
    ("deploy", "projectAdopts"): {"other": "p-gone"},
    ("chart", "checkpoints", "owner"): "p-platform",
    ("chart", "checkpoints", "adoptOwner"): "p-gone",
    ("deploy", "projectChoices"): {"priorityClassName": ["training"]},
    ("chart", "progress", "image"): "registry.example.com/platform/sidecar:2",
}


def test_every_platform_only_key_has_a_case():
    assert set(PLATFORM_VALUES) == set(deployctl.PLATFORM_ONLY)


def without(values, path):
    values = copy.deepcopy(values)
    node = values
    for part in path[:-1]:
        node = node[part]
    node.pop(path[-1], None)
    return values


ANCESTOR_CASES = {f"{'.'.join(key)} through {'.'.join(key[:depth])}: null": (key, depth)
                  for key in PLATFORM_VALUES for depth in range(1, len(key))}


@pytest.mark.parametrize("case", ANCESTOR_CASES, ids=ANCESTOR_CASES.keys())
def test_a_parent_set_to_null_and_rebuilt_cannot_drop_a_platform_only_key(tree, capsys, case):
    key, depth = ANCESTOR_CASES[case]
    set_key("dev.yaml", *key, PLATFORM_VALUES[key])(tree)
    platform = deployctl.platform_view(deployctl.load_layers("dev", None)[0])
    parent = key[:depth]
    under = [k for k in deployctl.PLATFORM_ONLY if k[:depth] == parent]
    for pinned in under:  # everything the platform had there, less its platform-only keys
        platform = without(platform, pinned)
    rebuilt = deployctl.lookup(platform, parent)
    set_key("projects/example/values.yaml", *parent, None)(tree)
    (tree / "values" / "projects" / "example" / "dev.yaml").write_text(json.dumps(
        {parent[0]: rebuilt} if depth == 1 else {parent[0]: {parent[1]: rebuilt}}))
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 1 and "upgrade" not in out, out
    assert PROJECT in err and "platform" in err and any(f" {'.'.join(k)}:" in err for k in under), err
    assert len(err.strip().splitlines()) == 1


def test_a_rebuilt_parent_is_fine_where_the_platform_pinned_nothing_under_it(tree, capsys):
    set_key("projects/example/values.yaml", "chart", "checkpoints", None)(tree)
    (tree / "values" / "projects" / "example" / "dev.yaml").write_text(json.dumps(
        {"chart": {"checkpoints": {"mountPath": "/checkpoints"}}}))
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 0, err  # resumeAcrossWorldSizes: the chart's default, as the platform left it
    set_key("dev.yaml", "chart", "checkpoints", "resumeAcrossWorldSizes", False)(tree)
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 1 and f"{PROJECT}dev.yaml: chart.checkpoints.resumeAcrossWorldSizes" in err, err


# ---------------------------------------------------------------- glue: pinned fields of the rendered pods

PINS = {  # what the platform's dev.yaml pins in the test tree
    "global": {"priorityClassName": "training", "nodeSelector": {"pool": "cpu"},
               "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
               "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                   {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}},
    "scheduling": {"kueueQueueName": "team-queue"},
    "checkpoints": {"existingClaim": "ckpt"},
}
OTHER = {"priorityClassName": "system-cluster-critical", "nodeSelector": {"pool": "other-team"},
         "tolerations": [{"operator": "Exists"}],
         "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
             {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}}


def pin_platform(tree):
    for section, values in PINS.items():
        for key, value in values.items():
            set_key("dev.yaml", "chart", section, key, value)(tree)


PIN_CASES = {
    **{f"{component}.{field}": ((component, field), OTHER[field], field)
       for field in OTHER for component in ("global", "worker", "launcher")},
    "global: null, rebuilt": (("global",), None, "priorityClassName"),
    "scheduling.schedulerName": (("scheduling", "schedulerName"), "other-scheduler", "schedulerName"),
    "scheduling.kueueQueueName cleared": (("scheduling", "kueueQueueName"), "", "kueueQueueName"),
    "scheduling.kueueQueueName of another team": (("scheduling", "kueueQueueName"), "other", "kueueQueueName"),
    "scheduling: null, rebuilt": (("scheduling",), None, "kueueQueueName"),
    "scheduling.volcano.enabled": (("scheduling", "volcano"), {"enabled": True, "queue": "gold"}, "schedulerName"),
    "checkpoints.existingClaim of another team": (("checkpoints", "existingClaim"), "other-ckpt", "checkpointVolume"),
    "checkpoints.existingClaim cleared": (("checkpoints", "existingClaim"), "", "checkpointVolume"),
    "configCheck.kueueQueueName of another team": (("configCheck", "kueueQueueName"), "other", "kueueQueueName"),
}


@pytest.mark.parametrize("case", PIN_CASES, ids=PIN_CASES.keys())
def test_a_project_cannot_move_its_pods_off_what_the_platform_pinned(tree, capsys, case):
    path, value, field = PIN_CASES[case]
    pin_platform(tree)
    set_key("projects/example/values.yaml", "chart", *path, value)(tree)
    if value is None:  # a later layer rebuilds the section without the pinned keys: the chart's defaults apply
        (tree / "values" / "projects" / "example" / "dev.yaml").write_text(json.dumps({"chart": {path[0]: {}}}))
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 1 and "upgrade" not in out, out
    assert PROJECT in err and f"deploy.projectChoices.{field}" in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_platform_can_list_what_a_project_may_choose(tree, capsys):
    pin_platform(tree)
    set_key("dev.yaml", "deploy", "projectChoices", {"priorityClassName": ["training", "training-low"],
                                                     "kueueQueueName": ["team-queue", "team-batch"]})(tree)
    set_key("projects/example/values.yaml", "chart", "worker", "priorityClassName", "training-low")(tree)
    set_key("projects/example/values.yaml", "chart", "launcher", "priorityClassName", "training-low")(tree)
    set_key("projects/example/values.yaml", "chart", "scheduling", "kueueQueueName", "team-batch")(tree)
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 0, err
    set_key("projects/example/values.yaml", "chart", "worker", "priorityClassName", "system-node-critical")(tree)
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 1 and '"training", "training-low"' in err, err


def test_a_project_changing_what_is_its_own_deploys(tree, capsys):
    pin_platform(tree)
    for key, value in (("image", {"tag": "team-1.2"}), ("env", [{"name": "TEAM", "value": "a"}]),
                       ("launchMode", "nossh"), ("worker", {"podLabels": {"team": "a"}})):
        set_key("projects/example/values.yaml", "chart", key, value)(tree)
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 0, err


def test_the_platform_gives_one_project_another_releases_checkpoints(tree, capsys):
    set_key("dev.yaml", "chart", "checkpoints", "existingClaim", "ckpt")(tree)
    set_key("dev.yaml", "deploy", "projectResumeFrom", {"example": "ml-dev/old-run"})(tree)
    code, out, err = run("template", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert '"/etc/deepspeed/resume-from"' in out and '"ml-dev/old-run"' in out
    code, out, err = run("plan", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert ("WARNING: checkpoints.resumeFrom ml-dev/old-run: DeepSpeed loads checkpoints with torch.load("
            "weights_only=False), which runs code stored in them: this release's ranks run the code of release "
            "ml-dev/old-run") in out
    set_key("projects/example/values.yaml", "chart", "checkpoints", "resumeFrom", "ml-dev/other")(tree)
    code, out, err = run("template", *DEV_EXAMPLE, capsys=capsys)
    assert code == 1 and PROJECT in err and "chart.checkpoints.resumeFrom" in err, err




def test_the_sidecar_that_holds_the_token_runs_the_platforms_image_or_none(tree, capsys):
    """With chart.progress.image empty the token-holding sidecar would run the workers' image, which the project
    chooses: refused, saying how to run without the sidecar; without it, or with the platform's image, it deploys."""
    set_key("dev.yaml", "chart", "progress", "image", "")(tree)  # the platform pins no sidecar image
    set_key("projects/example/values.yaml", "chart", "image", {"tag": "team-1.2"})(tree)
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 1 and "upgrade" not in out, out
    assert PROJECT in err and "progress sidecar's image" in err and "deploy.projectChoices.progressImage" in err, err
    assert "chart.progress.enabled: false" in err and len(err.strip().splitlines()) == 1, err
    set_key("projects/example/values.yaml", "chart", "progress", "enabled", False)(tree)
    set_key("projects/example/values.yaml", "chart", "launcher", "scaleDownWorkers", False)(tree)
    code, out, err = run("template", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0 and "initContainers" not in out, err
    set_key("dev.yaml", "chart", "progress", "image", "registry.example.com/platform/sidecar:2")(tree)
    set_key("projects/example/values.yaml", "chart", "progress", "enabled", True)(tree)
    code, out, err = run("template", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert out.count('image: "registry.example.com/platform/sidecar:2"') == 2  # the workers' and the launcher's


# ---------------------------------------------------------------- glue: the project's identity owns its storage

def test_the_platforms_identity_of_a_project_reaches_every_container_that_keeps_its_storage(tree, capsys):
    """deploy.projectIds: the worker's container (its volume) and, with a bucket, the restore container and the
    sidecar (the bucket's prefix) get it; the plan says it, and an adoption as a warning."""
    set_key("dev.yaml", "deploy", "projectIds", {"example": "p-7f3a", "hf-example": "p-91c0"})(tree)
    set_key("dev.yaml", "chart", "checkpoints", "objectStore", {"bucket": "ckpt", "endpoint": "https://s3.example.com",
                                                                "credentialsSecret": "s3"})(tree)
    code, out, err = run("plan", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0, err
    assert "  owner       project identity p-7f3a: its storage" in out and "takes over" not in out, out
    docs = [d for d in common_docs(tree) if d.get("kind") in ("StatefulSet", "Job")]
    owners = {(d["metadata"]["name"], c["name"]): {e["name"]: e.get("value") for e in c.get("env", [])}.get(
        "DS_CHECKPOINT_OWNER") for d in docs for c in (*d["spec"]["template"]["spec"].get("initContainers", []),
                                                      *d["spec"]["template"]["spec"]["containers"])}
    assert owners[("example-deepspeed-training-worker", "worker")] == "p-7f3a", owners
    assert {v for (name, c), v in owners.items() if c in ("restore", "progress") and "worker" in name} == \
        {"p-7f3a"}, owners
    assert owners[("example-deepspeed-training-launcher-1", "launcher")] is None  # it mounts no checkpoint volume
    set_key("dev.yaml", "deploy", "projectAdopts", {"example": "p-old"})(tree)
    code, out, err = run("plan", *DEV_EXAMPLE, capsys=capsys)
    assert code == 0 and "  WARNING: takes over the storage of project identity p-old" in out, out


@pytest.mark.parametrize("ids, expected", [
    ({"example": "p-1", "hf-example": "p-1"}, "deploy.projectIds: projects example and hf-example have the identity "
                                               "p-1: each project needs its own"),
    ({"example": "P_1"}, "deploy.projectIds.example: 'P_1' does not match"),
    ({"example": "x" * 64}, "deploy.projectIds.example: '" + "x" * 64 + "' does not match"),
])
def test_an_identity_two_projects_share_or_out_of_its_grammar_is_refused_in_one_line(tree, capsys, ids, expected):
    set_key("dev.yaml", "deploy", "projectIds", ids)(tree)
    code, out, err = run("deploy", *DEV_EXAMPLE, "--dry-run", capsys=capsys)
    assert code == 1 and "upgrade" not in out, out
    assert "values/dev.yaml" in err and expected in err, err
    assert len(err.strip().splitlines()) == 1, err


def common_docs(tree):
    from scripts.deployctl import common
    return common.manifest_docs((tree / "build" / "example" / "dev" / "manifests.yaml").read_text())
