"""Model FLOPs utilisation: the model's training FLOPs per token (from its shape) against the accelerator's
peak, as PaLM (Chowdhery et al. 2022, appendix B) defines it, so GPU users can compare with published figures.

FLOPs per token = 6 N + 12 L d T: N the parameters that multiply (every weight matrix and bias, the tied
embedding / output projection counted once, position embeddings left out: a lookup costs nothing), L layers,
d the width, T the context (attention over the full T x T, no discount for the causal mask). Recomputed
activations are not counted (that would be hardware FLOPs utilisation).
"""

import torch
from torch import nn

# Dense (no sparsity) peak tensor throughput in TFLOP/s for 16-bit (bf16/fp16) and 32-bit (tf32 where the
# tensor cores do it, else fp32) math, from the vendors' datasheets; per torch device (an MI250X shows as two).
# Matched by substring of torch's device name, in this order: more specific names first.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("gb200", 2500.0, 1250.0),
    ("b200", 2250.0, 1100.0),
    ("h200 nvl", 835.5, 417.5),
    ("h200", 989.5, 494.7),
    ("h100 nvl", 835.5, 417.5),
    ("h100 pcie", 756.0, 378.0),
    ("h100", 989.4, 494.7),
    ("a100", 312.0, 156.0),
    ("l40s", 362.0, 183.0),
    ("l4", 121.0, 60.0),
    ("a10g", 70.0, 35.0),
    ("a10", 125.0, 62.5),
    ("v100-pcie", 112.0, 14.0),
    ("v100", 125.0, 15.7),
    ("mi300x", 1307.4, 653.7),
    ("mi250", 191.5, 95.7),
]


def flops_per_token(matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token."""
    return 6 * matmul_params + 12 * n_layer * d_model * seq_len


def model_flops_per_token(model: nn.Module, n_layer: int, d_model: int, seq_len: int) -> int:
    """flops_per_token() for a model: its distinct parameters less position embeddings (named *pos*emb* or
    *position*)."""
    params = {id(p): (name, p) for name, p in model.named_parameters()}.values()
    matmul = sum(p.numel() for name, p in params if not ("pos" in name and ("emb" in name or "position" in name)))
    return flops_per_token(matmul, n_layer, d_model, seq_len)


def peak_tflops(device_name: str, half_precision: bool) -> float | None:
    """The table's peak for this device and precision; None when the device is not in it (CPU, unknown GPU)."""
    name = device_name.lower()
    for key, half, single in PEAK_TFLOPS:
        if key in name:
            return half if half_precision else single
    return None


def device_name() -> str:
    return torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def mfu(tokens_per_s_per_device: float, flops_token: int, peak: float | None) -> float | None:
    """Fraction of the peak the model's FLOPs reach; None without a peak."""
    if not peak:
        return None
    return tokens_per_s_per_device * flops_token / (peak * 1e12)
