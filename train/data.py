"""Training data: a learnable synthetic source for smoke runs and a flat token file read with memmap.

Both are one global sequence of samples, a deterministic function of (seed, sample index). `position` counts
the samples the whole job has consumed; each data-parallel rank reads its micro-batch at samples(). A resumed
run, on the same or another number of ranks, passes the saved position and continues the same sequence.
"""

from pathlib import Path

import numpy as np
import torch

from train.config import DataConfig, ModelConfig


class DataError(ValueError):
    """The data cannot feed the configured run; names the file and what was expected."""


class SyntheticData:
    """Sequences x[t+1] = (a * x[t] + b) mod vocab with a random start per sample: random-looking tokens
    that a model can learn, so the loss falls. Sample i is the same whatever the world size (see samples())."""

    def __init__(self, cfg: DataConfig, model: ModelConfig, rank: int, world_size: int):
        self.seq_len, self.vocab = model.seq_len, model.vocab_size
        rng = np.random.default_rng(cfg.seed)
        self.a, self.b = int(rng.integers(1, self.vocab)) | 1, int(rng.integers(0, self.vocab))
        self.seed = cfg.seed

    def batch(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first + size - 1 of the global order."""
        tokens = np.empty((size, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = [np.random.default_rng([self.seed, i]).integers(0, self.vocab) for i in
                        range(first, first + size)]
        for t in range(self.seq_len):
            tokens[:, t + 1] = (self.a * tokens[:, t] + self.b) % self.vocab
        window = torch.from_numpy(tokens)
        return window[:, :-1], window[:, 1:]


class TokenFileData:
    """A flat file of token ids, cut into windows of seq_len + 1 tokens (stride seq_len) and visited in one
    seeded order over the whole file that changes each epoch. Sample i is the same whatever the world size, so
    a run resumed on another number of ranks continues exactly (see samples())."""

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
        self.windows = (len(self.tokens) - 1) // self.seq_len
        if self.windows < micro_batch * world_size:
            need = world_size * micro_batch * self.seq_len + 1
            raise DataError(
                f"data.path {path}: {len(self.tokens)} tokens is too small for one batch: {world_size} ranks x "
                f"train_micro_batch_size_per_gpu {micro_batch} x (model.seq_len {self.seq_len}) + 1 needs >= {need}")
        self._epoch, self._offsets = None, None
        start, end = shard_bounds(len(self.tokens), rank, world_size)  # each rank checks its slice once
        top = int(self.tokens[start:end].max())
        if top >= model.vocab_size:
            raise DataError(f"data.path {path}: token id {top} >= model.vocab_size {model.vocab_size}")

    def window_offsets(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:  # one permutation per epoch, not per sample
            order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._epoch, self._offsets = epoch, order * self.seq_len
        return self._offsets

    def batch(self, first: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first .. first + size - 1 of the global order."""
        rows = []
        for sample in range(first, first + size):
            epoch, index = divmod(sample, self.windows)
            offset = self.window_offsets(epoch)[index]
            rows.append(np.asarray(self.tokens[offset:offset + self.seq_len + 1], dtype=np.int64))
        window = torch.from_numpy(np.stack(rows))
        return window[:, :-1], window[:, 1:]


def shard_bounds(length: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard; the shards partition [0, length)."""
    return length * rank // world_size, length * (rank + 1) // world_size


def samples(position: int, micro: int, data_rank: int) -> int:
    """The first sample of this rank's micro-batch when `position` samples of the global order are used up:
    the data-parallel ranks take consecutive micro-batches, so a step uses micro x data_parallel samples and
    the order does not depend on the world size. The one rule of which rank reads what; `position` is what
    checkpoints store, and a run resumed on another number of ranks neither repeats nor skips a sample."""
    return position + data_rank * micro


def make_data(cfg: DataConfig, model: ModelConfig, rank: int, world_size: int, micro_batch: int):
    if cfg.path:
        return TokenFileData(cfg, model, rank, world_size, micro_batch)
    return SyntheticData(cfg, model, rank, world_size)
