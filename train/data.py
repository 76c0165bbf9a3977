"""Training data: a learnable synthetic source for smoke runs and a flat token file read with memmap.

Both are deterministic functions of (seed, rank, position), where position counts the samples this rank
has consumed; a resumed run passes the saved position and sees the same sample sequence.
"""

from pathlib import Path

import numpy as np
import torch

from train.config import DataConfig, ModelConfig


class DataError(ValueError):
    """The data cannot feed the configured run; names the file and what was expected."""


class SyntheticData:
    """Sequences x[t+1] = (a * x[t] + b) mod vocab with a random start per sample: random-looking tokens
    that a model can learn, so the loss falls. Each data-parallel rank draws its own samples."""

    def __init__(self, cfg: DataConfig, model: ModelConfig, rank: int, world_size: int):
        self.seq_len, self.vocab = model.seq_len, model.vocab_size
        rng = np.random.default_rng(cfg.seed)
        self.a, self.b = int(rng.integers(1, self.vocab)) | 1, int(rng.integers(0, self.vocab))
        self.seed, self.rank = cfg.seed, rank

    def batch(self, position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.rank, position])
        tokens = np.empty((size, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab, size)
        for t in range(self.seq_len):
            tokens[:, t + 1] = (self.a * tokens[:, t] + self.b) % self.vocab
        window = torch.from_numpy(tokens)
        return window[:, :-1], window[:, 1:]


class TokenFileData:
    """A flat file of token ids. Rank r owns the r-th contiguous 1/world_size of the file; its shard is cut
    into windows of seq_len + 1 tokens (stride seq_len), visited in a seeded order that changes each epoch."""

    def __init__(self, cfg: DataConfig, model: ModelConfig, rank: int, world_size: int, micro_batch: int):
        path = Path(cfg.path)
        if not path.is_file():
            raise DataError(f"data.path {path}: no such file")
        dtype = np.dtype(cfg.dtype)
        size = path.stat().st_size
        if size == 0 or size % dtype.itemsize:
            raise DataError(f"data.path {path}: {size} bytes is not a whole number of data.dtype {cfg.dtype} tokens "
                            f"({dtype.itemsize} bytes each; see `python -m train.tokenize`)")
        try:
            self.tokens = np.memmap(path, dtype=dtype, mode="r")
        except OSError as err:
            raise DataError(f"data.path {path}: cannot read: {err.strerror}") from None
        self.seq_len, self.seed = model.seq_len, cfg.seed
        self.start, self.end = shard_bounds(len(self.tokens), rank, world_size)
        self.windows = (self.end - self.start - 1) // self.seq_len
        if self.windows < micro_batch:
            need = world_size * (micro_batch * self.seq_len + 1)
            raise DataError(
                f"data.path {path}: {len(self.tokens)} tokens is too small for one batch: {world_size} ranks x "
                f"train_micro_batch_size_per_gpu {micro_batch} x (model.seq_len {self.seq_len}) + 1 needs >= {need}")
        self._epoch, self._offsets = None, None
        top = int(self.tokens[self.start:self.end].max())
        if top >= model.vocab_size:
            raise DataError(f"data.path {path}: token id {top} >= model.vocab_size {model.vocab_size}")

    def window_offsets(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:  # one permutation per epoch, not per sample
            order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._epoch, self._offsets = epoch, self.start + order * self.seq_len
        return self._offsets

    def batch(self, position: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for sample in range(position, position + size):
            epoch, index = divmod(sample, self.windows)
            offset = self.window_offsets(epoch)[index]
            rows.append(np.asarray(self.tokens[offset:offset + self.seq_len + 1], dtype=np.int64))
        window = torch.from_numpy(np.stack(rows))
        return window[:, :-1], window[:, 1:]


def shard_bounds(length: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard; the shards partition [0, length)."""
    return length * rank // world_size, length * (rank + 1) // world_size


def make_data(cfg: DataConfig, model: ModelConfig, rank: int, world_size: int, micro_batch: int):
    if cfg.path:
        return TokenFileData(cfg, model, rank, world_size, micro_batch)
    return SyntheticData(cfg, model, rank, world_size)
