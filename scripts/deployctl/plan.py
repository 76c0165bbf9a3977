"""What `make plan` and the dry run print: the release, the job's shape, batch, ZeRO, memory per GPU, and every
warning the platform should read (relaxed security, code it trusts)."""

from scripts.deployctl import common, fit
from scripts.deployctl.common import DeployError
from scripts.deployctl.dsconf import layout_of
from scripts.deployctl.helm import release_name
from scripts.deployctl.render import Rendered
from train.config import ModelConfig


def pipeline_plan(r: Rendered) -> list[str]:
    """The plan's lines for the pipeline layout: stages x data-parallel ranks, and each stage's layers."""
    layout = layout_of(r.effective)
    if layout.pipeline_stages == 1:
        return []
    from train.pipeline import stage_plan

    model = ModelConfig(**r.effective["train"]["config"].get("model", {}))
    lines = [f"  layout      {layout.pipeline_stages} pipeline stages x {layout.data_parallel} data-parallel ranks "
             f"(stage s, data-parallel rank d is rank s x {layout.data_parallel} + d)"]
    lines += [f"  stage {i:<5} {layers}: {count / 1e6:,.1f}M parameters" for i, (layers, count) in
              enumerate(stage_plan(model))]
    return lines


def memory_estimate(r: Rendered) -> tuple[int, int, int, str]:
    """(parameters, GPU bytes, CPU bytes, how) from DeepSpeed's ZeRO estimators for the configured model."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from train.model import build_model, count_parameters, largest_layer_parameters

    model_values = r.effective["train"]["config"].get("model", {})
    with torch.device("meta"):  # shapes only: no memory, no time, even for billions of parameters
        model = build_model(ModelConfig(**model_values))
    params = count_parameters(model)
    zero = r.ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    offload = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    gpus, nodes = r.effective["worker"]["gpusPerWorker"], r.effective["worker"]["replicas"]
    if stage == 3:
        offload_params = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
        # DeepSpeed 0.19 returns (cpu, gpu, largest layer's memory)
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest_layer_parameters(model), gpus, nodes,
                                                            cpu_offload=offload, cpu_offload_params=offload_params)
        how = "ZeRO-3 estimator"
    elif stage in (1, 2):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
        how = "ZeRO-2 estimator" + (" (ZeRO-1 needs somewhat more: its gradients are not partitioned)"
                                    if stage == 1 else "")
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, 1, 1, cpu_offload=False)
        how = "no partitioning (ZeRO-0)"
    return params, gpu, cpu, how


def human(size: float) -> str:
    return f"{size / 1024 ** 3:.1f} GiB" if size >= 1024 ** 3 else f"{size / 1024 ** 2:.0f} MiB"


RELAXATIONS_ANNOTATION = "deepspeed-training/security-relaxations"  # set by the chart's _validate.tpl


# What checkpoints.resumeFrom (deploy.projectResumeFrom) grants, said wherever it is set.
RESUME_FROM_TRUST = ("checkpoints.resumeFrom {source}: DeepSpeed loads checkpoints with "
                     "torch.load(weights_only=False), which runs code stored in them: this release's ranks run the "
                     "code of release {source}, with this release's secrets and volumes (whoever can write that "
                     "release's checkpoint directory can)")


LAUNCH_MODES = {"ssh": "ssh (a launcher Job runs deepspeed over pdsh to the workers' sshd)",
                "nossh": "nossh (an Indexed Job: each worker runs deepspeed for its node rank, no sshd)"}


def worker_pod_template(manifests: str) -> dict:
    """The workers' pod template: the StatefulSet's (launchMode ssh) or the Indexed Job's (nossh)."""
    for doc in common.manifest_docs(manifests):
        if doc.get("kind") in ("StatefulSet", "Job") and \
                doc["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker":
            return doc["spec"]["template"]
    raise DeployError("the chart rendered no worker pods")


def security_relaxations(manifests: str) -> list[str]:
    """The relaxed security defaults the chart reports on the worker pods (empty for the defaults)."""
    text = worker_pod_template(manifests)["metadata"].get("annotations", {}).get(RELAXATIONS_ANNOTATION, "")
    return [item for item in text.split("; ") if item]


def worker_env(manifests: str) -> dict[str, str]:
    """The worker container's plain env values as the chart rendered them."""
    containers = worker_pod_template(manifests)["spec"]["containers"]
    return {e["name"]: e["value"] for e in containers[0].get("env", []) if "value" in e}


def checkpoint_part_bytes(r: Rendered, params: int) -> int:
    """About what one worker's part of a checkpoint holds on per-worker volumes: the model's weights (each node's
    local rank 0 writes them, checkpoint.use_node_local_storage) and its share of the optimizer's fp32 master
    weights and Adam moments (12 bytes a parameter; all of them at ZeRO 0)."""
    weights = 4 if r.ds_config.get("bf16", {}).get("enabled") is not True and \
        r.ds_config.get("fp16", {}).get("enabled") is not True else 2
    stage = r.ds_config.get("zero_optimization", {}).get("stage", 0)
    return params * weights + params * 12 // (r.effective["worker"]["replicas"] if stage else 1)


def storage_plan(r: Rendered, manifests: str, params: int | None) -> str:
    """The plan's line for where checkpoints live, and what the peer copy costs (the chart decides whether it is
    on: its env on the workers)."""
    env, checkpoints = worker_env(manifests), r.effective["checkpoints"]
    if env.get("DS_CHECKPOINT_STORAGE") != "per-worker":
        where = f"the shared claim {checkpoints['existingClaim']}" if checkpoints["existingClaim"] else \
            "one worker's volume"
        return f"  checkpoints {where}"
    volume = "a claim per worker" if checkpoints["volumeClaimSpec"] else "an emptyDir per worker pod"
    line = f"  checkpoints per-worker volumes ({volume}); "
    if env.get("DS_PEER_COPY_PORT"):
        cost = (f"~{human(checkpoint_part_bytes(r, params))} per worker" if params else "the size of one part")
        return line + (f"peer copy on: each worker's volume also keeps its neighbour's newest part ({cost}: that much "
                       "more room on every volume, and that much over the pod network per save, in the background); "
                       "survives the loss of one pod or node, not of two neighbouring ones")
    why = "checkpoints.peerCopy: false" if not checkpoints["peerCopy"] else \
        "networkPolicy.enabled: false, which would open the copies to every pod"
    return line + f"peer copy off ({why}): a lost pod's part of every checkpoint is lost with it"


def plan(r: Rendered, context: str | None, manifests: str) -> str:
    batch = ["auto (filled by the program)" if n is None else n for n in r.batch]
    zero = r.ds_config.get("zero_optimization", {})
    precision = "bf16" if r.ds_config.get("bf16", {}).get("enabled") else (
        "fp16" if r.ds_config.get("fp16", {}).get("enabled") else "fp32")
    worker, train = r.effective["worker"], r.effective["train"]
    gpu_name = worker["gpuResourceName"]
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    program = train["script"] or f"--module {train['module']}"
    hang = r.effective["hangDetection"]
    lines = [
        f"plan: ENV={r.env} PROJECT={r.project or '-'} (layers: {', '.join(r.sources)})",
        f"  release     {release_name(r)} in namespace {r.settings['deploy']['namespace']}, kube context "
        f"{context or '(current)'}",
        f"  workers     {worker['replicas']} x {worker['gpusPerWorker']} {gpu_name or 'CPU ranks'} = world size "
        f"{r.world_size}",
        f"  batch       micro {batch[0]} x accumulation {batch[1]} x {layout_of(r.effective).describe()} = "
        f"global {batch[2]}",
        f"  deepspeed   preset {r.settings['deepspeed']['preset']}: ZeRO stage {zero.get('stage', 0)}, {precision}, "
        f"optimizer offload {offload}",
        f"  launch      {LAUNCH_MODES[r.effective['launchMode']]}, a failure budget of "
        f"{r.effective['job']['runRetries']} failed runs per job, retried in the pods (preemptions do not count: "
        f"up to {r.effective['job']['preemptionRetries']} of them); "
        f"collective timeout {r.effective['deepspeed']['collectiveTimeoutMinutes']} min",
        "  hangs       " + (f"watchdog in the worker pods: {hang['startupSeconds']} s to a rank's first step, then "
                             f"{hang['stepSeconds']} s (or 10x its step time) per step, {hang['checkpointSeconds']} s "
                             "per save or restore" + (f"; {hang['signalSeconds']} s for a stopped rank, or one idle "
                                                      "outside any collective while a peer waits in one"
                                                      if hang["signalSeconds"] else "") if hang["enabled"]
                             else "no watchdog (hangDetection.enabled: false): only the collective timeout"),
        f"  program     {program} ({train['argsConvention']} arguments"
        + (", fills the ds_config's \"auto\" values)" if train["fillsDsConfigAuto"] else ")"),
    ]
    params = None
    if r.runs_train_package and r.effective["train"]["config"].get("model", {}).get("hf_config"):
        lines.append("  model       a Hugging Face config read in the pods (model.hf_config): no estimate here")
    elif r.runs_train_package:
        params, gpu_bytes, cpu_bytes, how = memory_estimate(r)
        lines += [f"  model       {params / 1e6:,.1f}M parameters",
                  *pipeline_plan(r),
                  f"  memory      model states ~{human(gpu_bytes)} per GPU, ~{human(cpu_bytes)} host per node "
                  f"({how}; activations come on top)"]
        limit = r.settings["deepspeed"]["gpuMemoryGiB"]
        if gpu_name and gpu_bytes > limit * 1024 ** 3:
            lines.append(f"  WARNING: model states need ~{gpu_bytes / 1024 ** 3:.1f} GiB per GPU but the GPUs have "
                         f"{limit} GiB (deepspeed.gpuMemoryGiB): use more GPUs, ZeRO-3 or offload (preset "
                         "zero3-offload-bf16)")
    else:
        lines.append("  model       the program's own (no estimate)")
    lines.append(storage_plan(r, manifests, params))
    groups = fit.pod_groups(manifests)
    lines += [fit.requests_line(groups), *fit.fit_lines(groups, context)]
    lines += [f"  WARNING: {warning}" for warning in r.warnings]
    if resume_from := r.effective["checkpoints"]["resumeFrom"]:
        lines.append(f"  WARNING: {RESUME_FROM_TRUST.format(source=resume_from)}")
    if owner := r.effective["checkpoints"]["owner"]:
        lines.append(f"  owner       project identity {owner}: its storage (volumes, the bucket's prefix) refuses to "
                     "start on another identity's data")
    if adopted := r.effective["checkpoints"]["adoptOwner"]:
        lines.append(f"  WARNING: takes over the storage of project identity {adopted} (deploy.projectAdopts): its "
                     "checkpoints, ledger and goodput become this project's")
    for relaxation in security_relaxations(manifests):
        lines.append(f"  WARNING: security relaxed (allowSecurityRelaxations): {relaxation}")
    lines.append(f"  rendered    {r.out.relative_to(common.ROOT)}/values.yaml, ds_config.json, train_config.json, "
                 "manifests.yaml")
    return "\n".join(lines)
