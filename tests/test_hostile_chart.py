"""Hostile and malformed values given straight to the chart (`helm install -f`), with helm 4 and helm 3.

Every case must stop at render time with a message naming the key: nothing reaches the API server, nothing
reaches a remote shell. The injection cases are GENERATED from every string slot of values.yaml (and of the
maps and lists of strings its schema declares), so a value is covered the day it is added.
"""

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.support.chart import CHART, ROOT, HelmError, by_kind, container, helm_binaries, render_chart

HELMS = helm_binaries()
pytestmark = pytest.mark.skipif(not HELMS, reason="no helm binary; run `make setup`")

NL_DOC = "x\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: pwn}"
NL_FIELD = "x\nhostPID: true"
SHELL = "$(touch /tmp/pwned)"
SHELL_QUOTE = 'x";touch /tmp/pwned;"'
PAYLOADS = {"newline-document": NL_DOC, "newline-field": NL_FIELD, "command-substitution": SHELL,
            "quote-break": SHELL_QUOTE, "unicode-line-separator": "x\u2028kind: Secret\u2028data:",
            "next-line": "x\u0085hostPID: true"}
ZERO2 = {"train_micro_batch_size_per_gpu": 1}
OPT_IN = "allowSecurityRelaxations"

# (values, substrings the error must contain: the key and what was wrong)
BAD = {
    # Names and references: patterns, so a newline never reaches a manifest
    "claim name with a document": ({"checkpoints": {"existingClaim": NL_DOC}}, ["existingClaim"]),
    "data claim with a field": ({"data": {"existingClaim": NL_FIELD}}, ["existingClaim"]),
    "priority class with a field": ({"worker": {"priorityClassName": NL_FIELD}}, ["priorityClassName"]),
    "global priority class": ({"global": {"priorityClassName": "a b"}}, ["priorityClassName"]),
    "scheduler name": ({"scheduling": {"schedulerName": NL_FIELD}}, ["schedulerName"]),
    "kueue queue": ({"scheduling": {"kueueQueueName": "q\nx: y"}}, ["kueueQueueName"]),
    "volcano queue": ({"scheduling": {"volcano": {"enabled": True, "queue": NL_DOC}}}, ["queue"]),
    "service account name": ({"serviceAccount": {"name": "sa\nautomountServiceAccountToken: true"}}, ["name"]),
    "upper-case name override": ({"nameOverride": "Trainer"}, ["nameOverride"]),
    "underscore full name": ({"fullnameOverride": "my_job"}, ["fullnameOverride"]),
    "image tag with a field": ({"image": {"tag": "v1\nsecurityContext: {privileged: true}"}}, ["tag"]),
    "image repository upper case": ({"image": {"repository": "Registry/Img"}}, ["repository"]),
    "image repository with a space": ({"image": {"repository": "reg/img latest"}}, ["repository"]),
    "existing secret": ({"ssh": {"existingSecret": "s\n---\nkind: Secret"}}, ["existingSecret"]),
    "pull secret": ({"image": {"pullSecrets": ["cred\nx: y"]}}, ["pullSecrets"]),
    "cluster domain": ({"clusterDomain": "cluster.local;id"}, ["clusterDomain"]),
    "gpu resource name": ({"worker": {"gpuResourceName": "nvidia.com/gpu\nx: y"}}, ["gpuResourceName"]),
    "shm size": ({"worker": {"shmSize": "1Gi\nmedium: x"}}, ["shmSize"]),
    "node selector value": ({"global": {"nodeSelector": {"pool": "gpu\nhostNetwork: true"}}}, ["nodeSelector"]),
    "node selector key": ({"worker": {"nodeSelector": {"a b": "c"}}}, ["nodeSelector"]),
    "label value with a space": ({"worker": {"podLabels": {"team": "a b"}}}, ["podLabels"]),
    "annotation key": ({"launcher": {"podAnnotations": {"x\ny": "z"}}}, ["podAnnotations"]),
    "service account annotation": ({"serviceAccount": {"annotations": {"a": 1}}}, ["annotations"]),
    # Paths
    "home with ..": ({"image": {"homeDir": "/home/../root"}}, ["homeDir"]),
    "relative home": ({"image": {"homeDir": "home"}}, ["homeDir"]),
    "checkpoint path with ..": ({"checkpoints": {"mountPath": "/ckpt/../etc"}}, ["mountPath"]),
    "checkpoint path with a space": ({"checkpoints": {"mountPath": "/ck pt"}}, ["mountPath"]),
    "data path with a shell": ({"data": {"mountPath": "/data;id"}}, ["mountPath"]),
    "extra mount relative": ({"worker": {"extraVolumes": [{"name": "x", "emptyDir": {}}],
                                         "extraVolumeMounts": [{"name": "x", "mountPath": "x"}]}}, ["mountPath"]),
    "extra mount subPath ..": ({"worker": {"extraVolumes": [{"name": "x", "emptyDir": {}}],
                                           "extraVolumeMounts": [{"name": "x", "mountPath": "/x",
                                                                  "subPath": "../etc"}]}}, ["subPath"]),
    # Collisions the API server would refuse mid-install
    "data and checkpoints at one path": ({"data": {"existingClaim": "corpus", "mountPath": "/checkpoints"}},
                                         ["data.mountPath", "checkpoints.mountPath"]),
    "checkpoints at /tmp": ({"checkpoints": {"mountPath": "/tmp"}}, ["checkpoints.mountPath", "/tmp"]),
    "home at /tmp": ({"image": {"homeDir": "/tmp"}}, ["image.homeDir", "/tmp"]),
    "extra mount over /dev/shm": ({"worker": {"extraVolumes": [{"name": "x", "emptyDir": {}}],
                                              "extraVolumeMounts": [{"name": "x", "mountPath": "/dev/shm"}]}},
                                  ["worker.extraVolumeMounts[0].mountPath", "/dev/shm"]),
    "extra volume named like the chart's": ({"worker": {"extraVolumes": [{"name": "config", "emptyDir": {}}]}},
                                            ["worker.extraVolumes[0]", "config"]),
    "two extra volumes of one name": ({"worker": {"extraVolumes": [{"name": "x", "emptyDir": {}},
                                                                   {"name": "x", "emptyDir": {}}]}},
                                      ["worker.extraVolumes[1]"]),
    "mount of a missing volume": ({"worker": {"extraVolumeMounts": [{"name": "nope", "mountPath": "/x"}]}},
                                  ["worker.extraVolumeMounts[0]", "nope"]),
    "checkpoints over /etc": ({"checkpoints": {"mountPath": "/etc"}}, ["checkpoints.mountPath", "/etc"]),
    "home over the venv": ({"image": {"homeDir": "/opt/venv/home"}}, ["image.homeDir", "/opt/venv"]),
    "extra mount under /usr": ({"worker": {"extraVolumes": [{"name": "x", "emptyDir": {}}],
                                           "extraVolumeMounts": [{"name": "x", "mountPath": "/usr/lib/x"}]}},
                               ["worker.extraVolumeMounts[0].mountPath", "/usr/lib/x"]),
    "privileged rendezvous port": ({"deepspeed": {"masterPort": 80}}, ["masterPort"]),
    "empty /dev/shm": ({"worker": {"shmSize": "0"}}, ["shmSize"]),
    "digest that is no digest": ({"image": {"digest": "latest"}}, ["digest"]),
    "env that makes shells run code": ({"env": [{"name": "BASH_ENV", "value": "/tmp/x"}]}, ["env[0] (BASH_ENV)"]),
    "ssh port is the rendezvous port": ({"ssh": {"port": 29500}}, ["ssh.port", "deepspeed.masterPort"]),
    # Env
    "duplicate env": ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, ["env[1] (A)"]),
    "env in env and extraEnv": ({"env": [{"name": "A", "value": "1"}],
                                 "worker": {"extraEnv": [{"name": "A", "value": "2"}]}}, ["A", "already set"]),
    "env overrides HOME": ({"env": [{"name": "HOME", "value": "/root"}]}, ["env[0] (HOME)"]),
    "env overrides RANK": ({"env": [{"name": "RANK", "value": "0"}]}, ["env[0] (RANK)"]),
    "extraEnv overrides PATH": ({"worker": {"extraEnv": [{"name": "PATH", "value": "/x"}]}},
                                ["worker.extraEnv[0] (PATH)"]),
    "extraEnv overrides a chart path": ({"worker": {"extraEnv": [{"name": "DS_CONFIG_DIR", "value": "/x"}]}},
                                        ["DS_CONFIG_DIR"]),
    "plain HF_TOKEN": ({"env": [{"name": "HF_TOKEN", "value": "hf_abc"}]}, ["env[0] (HF_TOKEN)", "valueFrom"]),
    "plain api key in extraEnv": ({"worker": {"extraEnv": [{"name": "WANDB_API_KEY", "value": "k"}]}},
                                  ["WANDB_API_KEY", "valueFrom"]),
    "plain password": ({"env": [{"name": "DB_PASSWORD", "value": "p"}]}, ["DB_PASSWORD"]),
    "env value and valueFrom": ({"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}}]}, ["env"]),
    "env value with a control character": ({"env": [{"name": "A", "value": "a\x01b"}]}, ["env[0] (A)"]),
    "env value with a backtick": ({"env": [{"name": "A", "value": "`id`"}]}, ["env[0] (A)"]),
    "env name with a shell": ({"env": [{"name": "A;id", "value": "1"}]}, ["name"]),
    # Sizes
    "too many workers": ({"worker": {"replicas": 100000}}, ["replicas"]),
    "too many GPUs per worker": ({"worker": {"gpusPerWorker": 1000}}, ["gpusPerWorker"]),
    "replicas as a string": ({"worker": {"replicas": "2"}}, ["replicas"]),
    "config past the ConfigMap's 1 MiB": ({"train": {"config": {"notes": "x" * 1_100_000}}}, ["1 MiB"]),
    "zero deadline": ({"job": {"activeDeadlineSeconds": 0}}, ["activeDeadlineSeconds"]),
    "grace as a string": ({"worker": {"terminationGracePeriodSeconds": "120"}}, ["terminationGracePeriodSeconds"]),
    "cpu request that is no quantity": ({"worker": {"resources": {"requests": {"cpu": "1; rm"}}}}, ["cpu"]),
    "toleration with an unknown effect": ({"worker": {"tolerations": [{"key": "gpu", "effect": "Sometimes"}]}},
                                          ["effect"]),
    "secret reference without a key": ({"env": [{"name": "TOKEN_FILE", "valueFrom": {"secretKeyRef": {
        "name": "s"}}}]}, ["key"]),
    "claim spec with an unknown access mode": ({"worker": {"replicas": 1}, "checkpoints": {"volumeClaimSpec": {
        "accessModes": ["ReadWriteSometimes"]}}}, ["accessModes"]),
    "tolerations as a string": ({"worker": {"tolerations": "all"}}, ["tolerations"]),
    # The config check hook: a fixed small request and a short deadline (it runs the tenant's image)
    "config check given GPUs": ({"configCheck": {"resources": {"limits": {"nvidia.com/gpu": 8}}}},
                                ["configCheck", "resources"]),
    "config check for a day": ({"configCheck": {"timeoutSeconds": 86400}}, ["timeoutSeconds"]),
    "config check queue with a field": ({"configCheck": {"kueueQueueName": "q\nx: y"}}, ["kueueQueueName"]),
    # Resource names Kubernetes does not know, in every resources map (the API server would refuse them mid-install)
    "resource name typo": ({"worker": {"resources": {"requests": {"memroy": "2Gi"}}}},
                           ["worker.resources.requests", "memroy"]),
    "made-up bare resource": ({"launcher": {"resources": {"limits": {"gpu": 1}}}},
                              ["launcher.resources.limits", "gpu"]),
    "resource in kubernetes.io": ({"worker": {"resources": {"limits": {"kubernetes.io/batteries": 1}}}},
                                  ["worker.resources.limits", "kubernetes.io/batteries"]),
    "sidecar given a GPU": ({"progress": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
                            ["progress.resources.limits", "nvidia.com/gpu"]),
    "claim asking for cpu": ({"worker": {"replicas": 1}, "checkpoints": {"volumeClaimSpec": {"resources": {
        "requests": {"cpu": "1"}}}}}, ["checkpoints.volumeClaimSpec.resources.requests", "cpu"]),
    "GPU resource without a domain": ({"worker": {"gpuResourceName": "gpu"}}, ["gpuResourceName"]),
    "GPU resource in kubernetes.io": ({"worker": {"gpuResourceName": "kubernetes.io/gpu"}}, ["gpuResourceName"]),
    # Isolation
    "worker label spoofs the instance": ({"worker": {"podLabels": {"app.kubernetes.io/instance": "other"}}},
                                         ["worker.podLabels", "app.kubernetes.io/instance"]),
    "launcher label spoofs the component": ({"launcher": {"podLabels": {"app.kubernetes.io/component": "worker"}}},
                                            ["launcher.podLabels", "app.kubernetes.io/component"]),
    "label spoofs the chart": ({"worker": {"podLabels": {"helm.sh/chart": "x"}}}, ["helm.sh/chart"]),
    "label moves the pod to another queue": ({"worker": {"podLabels": {"kueue.x-k8s.io/queue-name": "vip"}}},
                                             ["kueue.x-k8s.io/queue-name"]),
    "label in a Kubernetes namespace": ({"worker": {"podLabels": {"apps.kubernetes.io/pod-index": "0"}}},
                                        ["apps.kubernetes.io/pod-index"]),
    "annotation replaces the checksum": ({"worker": {"podAnnotations": {"checksum/config": "x"}}},
                                         ["checksum/config"]),
    "annotation unconfines seccomp": ({"worker": {"podAnnotations": {
        "seccomp.security.alpha.kubernetes.io/pod": "unconfined"}}}, ["seccomp.security.alpha.kubernetes.io/pod"]),
    "annotation joins another gang": ({"worker": {"podAnnotations": {"scheduling.k8s.io/group-name": "x"}}},
                                      ["scheduling.k8s.io/group-name"]),
    "scale role to the default account": ({"serviceAccount": {"create": False, "name": "default"}}, ['"default"']),
    "volcano with another scheduler": ({"scheduling": {"schedulerName": "kai", "volcano": {"enabled": True}}},
                                       ["scheduling.schedulerName", "volcano"]),
    # Security relaxed without the opt-in
    "privileged": ({"securityContext": {"privileged": True}}, ["securityContext.privileged", OPT_IN]),
    "root user": ({"podSecurityContext": {"runAsUser": 0}}, ["podSecurityContext.runAsUser", OPT_IN]),
    "runAsNonRoot off": ({"podSecurityContext": {"runAsNonRoot": False}}, ["podSecurityContext.runAsNonRoot"]),
    "added capability": ({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}},
                         ["securityContext.capabilities.add: SYS_ADMIN"]),
    "capabilities not dropped": ({"securityContext": {"capabilities": {"drop": []}}},
                                 ["securityContext.capabilities.drop"]),
    "privilege escalation": ({"securityContext": {"allowPrivilegeEscalation": True}},
                             ["securityContext.allowPrivilegeEscalation"]),
    "writable root": ({"securityContext": {"readOnlyRootFilesystem": False}}, ["readOnlyRootFilesystem"]),
    "seccomp unconfined": ({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
                           ["podSecurityContext.seccompProfile.type: Unconfined"]),
    "hostPath volume": ({"worker": {"extraVolumes": [{"name": "host", "hostPath": {"path": "/"}}]}},
                        ["worker.extraVolumes[0] (host): hostPath volume"]),
    "nfs volume": ({"worker": {"extraVolumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}},
                   ["nfs volume"]),
    "network policy off": ({"networkPolicy": {"enabled": False}}, ["networkPolicy.enabled", OPT_IN]),
    "fsGroupChangePolicy the API refuses": ({"podSecurityContext": {"fsGroupChangePolicy": "Sometimes"}},
                                           ["fsGroupChangePolicy"]),
    "privileged as a string": ({"securityContext": {"privileged": "true"}}, ["privileged"]),
    "capability with a newline": ({"securityContext": {"capabilities": {"add": ["NET_ADMIN\nx: y"]}}}, ["add"]),
    "unknown securityContext field": ({"securityContext": {"privilegd": True}}, ["privilegd"]),
    "unmasked proc": ({"securityContext": {"procMount": "Unmasked"}}, ["procMount"]),
    "host fields are not values": ({"worker": {"hostNetwork": True}}, ["hostNetwork"]),
    # What reaches the remote shell
    "runner flag the chart owns": ({"deepspeed": {"runnerArgs": ["--master_addr=evil"]}},
                                   ["deepspeed.runnerArgs[0]", "--master_addr"]),
    "venv_script becomes `source X`": ({"deepspeed": {"runnerArgs": ["--venv_script=/tmp/x"]}},
                                       ["deepspeed.runnerArgs[0]"]),
    "launcher_args": ({"deepspeed": {"runnerArgs": ["--launcher_args=-R ssh"]}}, ["deepspeed.runnerArgs[0]"]),
    "allowed flag with a shell value": ({"deepspeed": {"runnerArgs": ["--enable_each_rank_log=/x$(id)"]}},
                                        ["deepspeed.runnerArgs[0]"]),
    "runner flag in a form DeepSpeed refuses": ({"deepspeed": {"runnerArgs": ["--log_level=verbose"]}},
                                                ["deepspeed.runnerArgs[0]", "expected the form"]),
    "bare flag given a value": ({"deepspeed": {"runnerArgs": ["--bind_cores_to_rank=yes"]}},
                                ["deepspeed.runnerArgs[0]"]),
    "flag missing its value": ({"deepspeed": {"runnerArgs": ["--enable_each_rank_log"]}},
                               ["deepspeed.runnerArgs[0]"]),
    "container may run as root": ({"securityContext": {"runAsNonRoot": False}}, ["securityContext.runAsNonRoot",
                                                                                  OPT_IN]),
    "projected service-account token": ({"worker": {"extraVolumes": [{"name": "tok", "projected": {"sources": [
        {"serviceAccountToken": {"audience": "sts.amazonaws.com", "path": "token"}}]}}]}},
        ["service-account token", OPT_IN]),
    "projected pod certificate": ({"worker": {"extraVolumes": [{"name": "cert", "projected": {"sources": [
        {"podCertificate": {"signerName": "example.com/signer", "keyType": "ED25519",
                            "credentialBundlePath": "bundle.pem"}}]}}]}},
        ["worker.extraVolumes[0] (cert): a projected podCertificate", OPT_IN]),
    "projected source the chart does not know": ({"worker": {"extraVolumes": [{"name": "x", "projected": {"sources": [
        {"configMap": {"name": "c"}}, {"futureCredential": {"audience": "x"}}]}}]}},
        ["a projected futureCredential", OPT_IN]),
    "checkpoints over /opt": ({"checkpoints": {"mountPath": "/opt"}}, ["checkpoints.mountPath", "/opt"]),
    "runner flag that shrinks the world": ({"deepspeed": {"runnerArgs": ["--num_gpus=1"]}},
                                           ["deepspeed.runnerArgs[0]", "--num_gpus"]),
    "runner arg that is no flag": ({"deepspeed": {"runnerArgs": ["rm"]}}, ["runnerArgs"]),
    "script with a shell": ({"train": {"script": "/code/train.py;id"}}, ["script"]),
    "relative script": ({"train": {"script": "train.py"}}, ["script"]),
    "module with a shell": ({"train": {"module": "train;id"}}, ["module"]),
    "arg with a semicolon": ({"train": {"args": ["--x=1;id"]}}, ["train.args[0]"]),
    "arg beside a placeholder": ({"train": {"args": ["{ds_config} $(id)"]}}, ["train.args[0]"]),
    "unknown convention": ({"train": {"argsConvention": "pytorch"}}, ["argsConvention"]),
    "release from a hostile fullname": ({"fullnameOverride": "a;b"}, ["fullnameOverride"]),
    # ds_config: the chart owns only its top-level keys (a copy generated from train/); the rest is train/'s,
    # which the config check hook runs (tests/e2e/test_config_check.py)
    "unknown top-level ds_config key": ({"deepspeed": {"config": {**ZERO2, "optimzer": {"type": "AdamW"}}}},
                                        ["deepspeed.config", "optimzer"]),
}


@pytest.mark.parametrize("helm", HELMS.values(), ids=HELMS.keys())
@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_bad_values_stop_at_render_naming_the_key(case, helm):
    values, expected = BAD[case]
    with pytest.raises(HelmError) as err:
        render_chart(values, helm=helm)
    for text in expected:
        assert text in err.value.stderr, err.value.stderr


BAD_RELEASES = {"leading digit": ("1job", "default"), "dot": ("a.b", "default"), "namespace": ("job", "Team_A")}


@pytest.mark.parametrize("helm", HELMS.values(), ids=HELMS.keys())
@pytest.mark.parametrize("case", BAD_RELEASES, ids=BAD_RELEASES.keys())
def test_release_and_namespace_names_the_objects_cannot_carry_are_refused(case, helm):
    release, namespace = BAD_RELEASES[case]
    with pytest.raises(HelmError) as err:
        render_chart(helm=helm, release=release, namespace=namespace)
    assert (release if case != "namespace" else namespace) in err.value.stderr


def test_nan_in_a_ds_config_is_refused(tmp_path):
    path = tmp_path / "nan.yaml"
    path.write_text("deepspeed:\n  config:\n    train_micro_batch_size_per_gpu: 1\n    gradient_clipping: .nan\n")
    for helm in HELMS.values():
        with pytest.raises(HelmError) as err:
            render_chart(values_files=[path], helm=helm)
        assert "gradient_clipping" in err.value.stderr or "NaN" in err.value.stderr, err.value.stderr


# ---------------------------------------------------------------- generated injections

def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def string_slots() -> list[tuple[tuple, str]]:
    """(key path, how to place a string there) for every string leaf of values.yaml, and one slot in every
    map or list of strings (or of env entries) that the schema declares."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    slots = []

    def walk(value, node, path):
        node = _resolve(schema, node or {})
        if isinstance(value, str):
            slots.append((path, "leaf"))
        elif isinstance(value, dict):
            props = node.get("properties", {})
            for key, sub in value.items():
                walk(sub, props.get(key, {}), (*path, key))
            extra = node.get("additionalProperties")
            if isinstance(extra, dict) and "string" in str(_resolve(schema, extra).get("type")):
                slots.append((path, "map-value"))
            if isinstance(extra, dict) or "propertyNames" in node:
                slots.append((path, "map-key"))
        elif isinstance(value, list):
            items = _resolve(schema, node.get("items", {}))
            if items.get("type") == "string":
                slots.append((path, "list"))
            elif "name" in items.get("properties", {}) and "value" in items.get("properties", {}):
                slots.append((path, "env-value"))

    walk(defaults, schema, ())
    return slots


def place(path: tuple, how: str, payload: str) -> dict:
    leaf = {"leaf": payload, "map-value": {"k": payload}, "map-key": {payload: "v"}, "list": [payload],
            "env-value": [{"name": "X", "value": payload}]}[how]
    values = leaf
    for key in reversed(path):
        values = {key: values}
    return values


SLOTS = string_slots()
BASELINE = None


def shape(docs: list[dict]) -> list[tuple]:
    """What a value may never change: the objects, and the set of fields of every pod spec and container."""
    out = []
    for doc in docs:
        out.append((doc["kind"], doc["metadata"]["name"].split("-")[-1]))
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod:
            out.append(tuple(sorted(pod)))
            out.append(tuple(sorted(container(doc))))
    return sorted(out, key=str)


def test_every_string_slot_of_values_yaml_is_covered():
    paths = {".".join(p) for p, _ in SLOTS}
    for key in ("checkpoints.existingClaim", "image.tag", "scheduling.schedulerName", "worker.podLabels",
                "env", "train.args", "deepspeed.runnerArgs", "nameOverride", "serviceAccount.name"):
        assert key in paths, sorted(paths)
    assert len(SLOTS) >= 40


@pytest.mark.parametrize("payload", PAYLOADS, ids=PAYLOADS.keys())
@pytest.mark.parametrize("slot", SLOTS, ids=[f"{'.'.join(p)}[{h}]" for p, h in SLOTS])
def test_no_string_value_escapes_its_field(slot, payload):
    """Each payload is either refused naming the key, or lands as data in its own field: the same objects,
    the same pod and container fields, and nothing of it in the remote shell's command or env file."""
    global BASELINE
    if BASELINE is None:
        BASELINE = shape(render_chart())
    path, how = slot
    text = PAYLOADS[payload]
    try:
        docs = render_chart(place(path, how, text))
    except HelmError as err:
        named = [str(k) for k in path] + ["X", "k", "value", "name"]
        assert any(k in err.stderr for k in named), err.stderr
        assert "panic" not in err.stderr
        return
    assert shape(docs) == BASELINE, f"{'.'.join(path)} changed the manifests' structure"
    job = by_kind(docs, "Job")[0]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    for arg in container(job)["args"]:
        assert "$(" not in arg and ";" not in arg and "\n" not in arg, arg
    for line in config["data"]["deepspeed_env"].splitlines():
        assert re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*=[^$`"\\]*', line), line
    assert not any(d["kind"] == "ClusterRoleBinding" for d in docs)


# ---------------------------------------------------------------- the chart's copies of Python facts

def _runner_flags() -> dict[str, str]:
    text = (CHART / "templates" / "_validate.tpl").read_text()
    body = text[text.index('define "deepspeed-training.userRunnerFlags"'):]
    items = re.findall(r'"([^"]+)"', body[body.index("dict "):body.index("| toJson")])
    return dict(zip(items[::2], items[1::2], strict=True))


def test_the_charts_ds_config_keys_are_generated_from_the_python_check_and_not_stale():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "chart_data.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(HelmError, match="unknown top-level key \"trian_batch_size\""):
        render_chart({"deepspeed": {"config": {"train_micro_batch_size_per_gpu": 1, "trian_batch_size": 8}}})


RUNNER_EXAMPLES = {"--bind_cores_to_rank": "--bind_cores_to_rank", "--bind_core_list": "--bind_core_list=0-3,8",
                   "--enable_each_rank_log": "--enable_each_rank_log=/checkpoints/logs", "--no_local_rank":
                   "--no_local_rank", "--save_pid": "--save_pid", "--log_level": "--log_level=warning",
                   "--quiet": "--quiet", "--force_multi": "--force_multi"}


def test_every_runner_flag_values_may_set_parses_in_deepspeeds_runner_in_the_allowed_form():
    from deepspeed.launcher import runner
    flags = _runner_flags()
    assert set(flags) == set(RUNNER_EXAMPLES)
    for flag, pattern in flags.items():
        arg = RUNNER_EXAMPLES[flag]
        assert re.fullmatch(pattern, arg), (pattern, arg)
        assert runner.parse_args([arg, "prog.py"]).user_script == "prog.py", flag
        with_its_partner = [arg, "--bind_cores_to_rank"] if flag == "--bind_core_list" else [arg]
        render_chart({"deepspeed": {"runnerArgs": with_its_partner}})
