"""The built-in GPT as a DeepSpeed PipelineModule (model.pipeline_stages > 1): token embedding, positions,
blocks, final LayerNorm and the tied output projection as layers, split over stages by parameter count.

Every rank first builds the plain GPT with the run's seed and copies its weights into the layers it holds,
so a pipeline starts from exactly the weights data parallelism would (a 1-stage pipeline gives the same
per-step losses as the plain model). Ranks: stage s, data-parallel rank d is global rank s * dp + d (the data
axis is innermost); both ends of a pipeline read the same micro-batches, so data is sharded by d.
"""

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime import utils as ds_utils
from torch import nn

from train.config import ModelConfig
from train.model import GPT, Block

TIED = "embedding"  # the token embedding, also the output projection
PARTITION = "parameters"  # balance stages by parameter count


class TokenEmbedding(nn.Embedding):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.vocab_size, cfg.d_model)


class AddPositions(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.pos_emb(torch.arange(x.shape[1], device=x.device)))


def output_projection(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, embedding.weight)


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def layer_specs(cfg: ModelConfig) -> list:
    return ([TiedLayerSpec(TIED, TokenEmbedding, cfg), LayerSpec(AddPositions, cfg)]
            + [LayerSpec(Block, cfg) for _ in range(cfg.n_layer)]
            + [LayerSpec(nn.LayerNorm, cfg.d_model),
               TiedLayerSpec(TIED, TokenEmbedding, cfg, forward_fn=output_projection, tied_weight_attr=["weight"])])


def _gpt_weights(gpt: GPT, index: int) -> dict:
    """The plain GPT's state for pipeline layer `index` (layers 0 and the last are the tied embedding)."""
    if index == 1:
        return {"pos_emb.weight": gpt.pos_emb.weight}
    if 2 <= index < 2 + gpt.cfg.n_layer:
        return gpt.blocks[index - 2].state_dict()
    if index == 2 + gpt.cfg.n_layer:
        return gpt.ln_f.state_dict()
    raise KeyError(index)


class PipelineGPT(PipelineModule):
    """GPT as pipeline layers; build after deepspeed.init_distributed()."""

    def __init__(self, cfg: ModelConfig, seed: int):
        torch.manual_seed(seed)
        reference = GPT(cfg)  # the same random stream as a data-parallel run
        with torch.no_grad():  # the tied weight's broadcast is not part of any graph
            super().__init__(layers=layer_specs(cfg), num_stages=cfg.pipeline_stages, loss_fn=loss,
                             partition_method=PARTITION, checkpointable_layers=["Block"])
            for name, module in self.named_children():  # the layers this stage holds are named by index
                if name.isdigit():
                    module.load_state_dict(_gpt_weights(reference, int(name)), strict=True)
            if TIED in self.tied_modules:
                self.tied_modules[TIED].weight.copy_(reference.tok_emb.weight)
        self.cfg = cfg

    def describe(self) -> str:
        return f"GPT in {self.cfg.pipeline_stages} pipeline stages"

    def shape(self) -> tuple[int, int]:
        return self.cfg.n_layer, self.cfg.d_model


def stage_plan(cfg: ModelConfig) -> list[tuple[str, int]]:
    """[(layer names, parameters)] per stage, as PipelineModule will split them (no process group needed). A
    stage holding a copy of the tied embedding counts it."""
    specs = layer_specs(cfg)
    with torch.device("meta"):  # shapes only: a plan of a large model allocates nothing
        sizes = [sum(p.numel() for p in spec.build().parameters()) for spec in specs]
    bounds = ds_utils.partition_balanced(weights=sizes, num_parts=cfg.pipeline_stages)
    plan = []
    for stage in range(cfg.pipeline_stages):
        names = [specs[i].typename.__name__ for i in range(bounds[stage], bounds[stage + 1])]
        plan.append((", ".join(_runs(names)), sum(sizes[bounds[stage]:bounds[stage + 1]])))
    return plan


def _runs(names: list[str]) -> list[str]:
    """['Block', 'Block', 'LayerNorm'] -> ['2 Block', 'LayerNorm']."""
    out: list[list] = []
    for name in names:
        if out and out[-1][1] == name:
            out[-1][0] += 1
        else:
            out.append([1, name])
    return [f"{n} {name}" if n > 1 else name for n, name in out]
