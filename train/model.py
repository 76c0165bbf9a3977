"""A GPT-style decoder-only language model (pre-LayerNorm, causal attention, tied embeddings)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from train.config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by depth so activations do not grow with n_layer.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def describe(self) -> str:
        return "GPT"

    def shape(self) -> tuple[int, int]:
        """(layers, width), for the FLOPs per token (train/mfu.py)."""
        return self.cfg.n_layer, self.cfg.d_model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Returns the mean next-token cross-entropy of `idx` against `targets` (both [batch, seq])."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class HFCausalLM(nn.Module):
    """A `transformers` causal LM built from a local config (never fetched from a hub), with GPT's forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        from train.config import ConfigError

        try:
            config = AutoConfig.from_pretrained(cfg.hf_config, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.hf_config {cfg.hf_config}: not a Hugging Face config dir: {err}") from None
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if config.vocab_size < cfg.vocab_size or (positions and positions < cfg.seq_len):
            raise ConfigError(f"model.hf_config {cfg.hf_config}: vocab_size {config.vocab_size} and positions "
                              f"{positions} must cover model.vocab_size {cfg.vocab_size} and model.seq_len "
                              f"{cfg.seq_len} (the data's token range and sample length)")
        self.model = AutoModelForCausalLM.from_config(config)
        self.source = cfg.hf_config

    def describe(self) -> str:
        return f"{self.model.config.model_type} from {self.source}"

    def shape(self) -> tuple[int, int]:
        config = self.model.config
        return (getattr(config, "num_hidden_layers", None) or config.n_layer,
                getattr(config, "hidden_size", None) or config.n_embd)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=idx).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: ModelConfig) -> nn.Module:
    return HFCausalLM(cfg) if cfg.hf_config else GPT(cfg)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def largest_layer_parameters(model: nn.Module) -> int:
    """Parameters of the largest single module with its own weights (for ZeRO-3 memory estimates)."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
