"""A Hugging Face `Trainer` program as teams write them, launched by the chart with the `huggingface`
convention (`--deepspeed <ds_config> --output_dir <checkpoints>`; the ds_config's "auto" values are the
Trainer's to fill: `train.fillsDsConfigAuto: true`).

    deepspeed prog.py --deepspeed ds_config.json --output_dir /checkpoints [--train_file corpus.txt]
        [--model_config DIR] [any TrainingArguments flag]

Nothing is downloaded: the causal LM is built from a local config (a tiny GPT-2 by default) and the text is
tokenised as UTF-8 bytes. Resume is the Trainer pattern: continue from the newest checkpoint-N in the output
dir. On rank 0 the loss history goes to <output_dir>/log_history.json. RankHeartbeat is the one line that gives it
the chart's hang detection.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, HfArgumentParser, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from train.hf_callback import RankHeartbeat  # the train package is in every image of the chart
from train.main import exit_cleanly

SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog. " * 400


@dataclass
class ProgramArguments:
    train_file: str = field(default="", metadata={"help": "UTF-8 text to train on; empty: a built-in sample."})
    model_config: str = field(default="", metadata={"help": "Directory with a config.json; empty: a tiny GPT-2."})
    block_size: int = field(default=64, metadata={"help": "Tokens per sample."})


class ByteBlocks(torch.utils.data.Dataset):
    """The text's UTF-8 bytes cut into blocks: token ids below 256, labels = inputs (the model shifts)."""

    def __init__(self, text: str, block_size: int):
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.blocks = ids[: len(ids) // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> int:
    program, args = HfArgumentParser((ProgramArguments, TrainingArguments)).parse_args_into_dataclasses()
    text = Path(program.train_file).read_text() if program.train_file else SAMPLE_TEXT
    if program.model_config:
        config = AutoConfig.from_pretrained(program.model_config, local_files_only=True)
    else:
        config = GPT2Config(vocab_size=256, n_positions=program.block_size, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=args, train_dataset=ByteBlocks(text, program.block_size),
                      callbacks=[RankHeartbeat()])  # the chart's hang detection: one line
    last = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
    if last:  # every process says it: on a volume per worker each reads its own node's copy
        print(f"hf_trainer: resuming from {last} (process {args.process_index})", flush=True)
    trainer.train(resume_from_checkpoint=last)
    if trainer.is_world_process_zero():
        history = Path(args.output_dir) / "log_history.json"
        history.write_text(json.dumps(trainer.state.log_history, indent=1))
        print(f"hf_trainer: done at global step {trainer.state.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    exit_cleanly(main())
