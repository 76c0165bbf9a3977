"""The e2e tier's chart values and set-up, shared by the e2e tests and bench/e2e_startup.py."""

import base64
from pathlib import Path

from tests.support.chart import HELM, ROOT, render_chart
from tests.support.harness import namespaces_available
from tests.support.train_run import cpu_ds_config

REASON = namespaces_available() or (None if HELM else "no helm binary; run `make setup`")
UID = 10001
COLLECTIVE_TIMEOUT_MINUTES = 1  # the shortest: a rank that waits for a dead peer fails within a minute
SECRET_VALUE = "s3cr3t-$(id)-`uname`"  # only the valueFrom channel may carry this


def e2e_values(shared_dir: Path, workers: int = 2, steps: int = 40, **train) -> dict:
    return {
        "worker": {"replicas": workers, "gpusPerWorker": 1, "gpuResourceName": "", "terminationGracePeriodSeconds": 20},
        "launcher": {"scaleDownWorkers": False}, "job": {"waitTimeoutSeconds": 60},
        "deepspeed": {"config": cpu_ds_config(stage=2, micro=4),
                      "collectiveTimeoutMinutes": COLLECTIVE_TIMEOUT_MINUTES},
        "train": {"module": "tests.e2e.rank_probe",
                  "config": {"steps": steps, "log_every": 10, "checkpoint_every": 10,
                             "model": {"n_layer": 2, "d_model": 64, "seq_len": 32}, **train}},
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"},
                # No e2e program compiles; without it every rank imports torch's compiler (inductor: ~0.9 s of
                # CPU) because DeepSpeed's ZeRO optimizer check imports its Muon module, which torch.compile()s.
                {"name": "TORCHDYNAMO_DISABLE", "value": "1"},
                {"name": "E2E_MARKER", "value": "from-the-chart"},
                {"name": "PYTHONPATH", "value": str(ROOT)},
                {"name": "TORCH_EXTENSIONS_DIR", "value": str(shared_dir)},
                {"name": "E2E_SECRET", "valueFrom": {"secretKeyRef": {"name": "e2e-secret", "key": "value"}}}],
        "checkpoints": {"existingClaim": "checkpoints"},
    }


def render(values: dict, release: str = "job") -> list[dict]:
    docs = render_chart(values, release=release)
    # What the cluster already holds: the Secret the valueFrom entry names.
    docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "e2e-secret", "namespace": "default"},
                 "data": {"value": base64.b64encode(SECRET_VALUE.encode()).decode()}})
    return docs
