"""Train module for the hang drills: the train package, except that on its first attempt rank HANG_RANK blocks
at step HANG_AT_STEP in a system call outside any collective (opening a FIFO nobody writes), as a data loader
stuck on a dead mount would. The marker under the checkpoint dir makes the retry train normally."""

import os
import sys
from pathlib import Path

import train.main
from train.main import main

HANG_RANK, HANG_AT_STEP = int(os.environ.get("HANG_RANK", "1")), int(os.environ.get("HANG_AT_STEP", "0"))
original_step = train.main.train_step


def read_the_stuck_mount(path: Path) -> None:
    os.mkfifo(path)
    with open(path) as f:  # blocks: no writer ever comes
        f.read()


def train_step(engine, inputs, position):
    step = position // (inputs.batch[2]) + 1  # samples of the whole job so far -> the step being run
    marker = Path(os.environ["DS_CHECKPOINT_DIR"]) / "hang-drill-done"
    if HANG_AT_STEP and step == HANG_AT_STEP and int(os.environ["RANK"]) == HANG_RANK and not marker.exists():
        marker.write_text("once")
        read_the_stuck_mount(Path(os.environ["DS_RANK_STATE_DIR"]) / "stuck-fifo")
    return original_step(engine, inputs, position)


train.main.train_step = train_step
sys.exit(main())
