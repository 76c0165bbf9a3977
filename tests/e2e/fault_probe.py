"""Train module for the fault drill (tests/drills/test_fault_drill.py): the train package, with one fault from the
env, each a real failure of the kind a program meets, on rank FAULT_RANK (default 1):
- FAULT=raise: raises at step FAULT_STEP in the attempts FAULT_ATTEMPTS names ("1", "all"): a program error;
- FAULT=block: blocks at step FAULT_STEP of attempt 1 in a system call outside any collective (opening a FIFO nobody
  writes), as a data loader on a dead mount would;
- FAULT_FROM_ATTEMPT=N (with any FAULT): every rank exits 1 before its first step in every attempt from N on, as
  a program broken at start-up does (no line, no step);
- FAULT=oom: at step FAULT_STEP of attempt 1, allocates memory until the kernel's OOM killer ends it (in a pod
  with a memory limit).
"""

import os
import sys
import time
from pathlib import Path

import train.main
from train.main import main

FAULT, RANK = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_RANK", "1"))
STEP = int(os.environ.get("FAULT_STEP", "0"))
ATTEMPT = int(os.environ.get("DS_ATTEMPT", "1"))
original_step = train.main.train_step


def train_step(engine, inputs, position):
    step = position // inputs.batch[2] + 1  # samples of the whole job so far -> the step being run
    if int(os.environ["RANK"]) == RANK and step == STEP:
        if FAULT == "raise" and os.environ.get("FAULT_ATTEMPTS", "1") in ("all", str(ATTEMPT)):
            raise RuntimeError(f"fault drill: the batch at step {step} has a bad shape (attempt {ATTEMPT})")
        if FAULT == "block" and ATTEMPT == 1:
            fifo = Path(os.environ["DS_RANK_STATE_DIR"]) / "stuck-fifo"
            os.mkfifo(fifo)
            with open(fifo) as f:  # blocks: no writer ever comes
                f.read()
        if FAULT == "oom" and ATTEMPT == 1:
            hoard = []
            while True:
                hoard.append(bytearray(64 << 20))  # touched: every page resident
                time.sleep(0.01)
    return original_step(engine, inputs, position)


train.main.train_step = train_step
if os.environ.get("FAULT_FROM_ATTEMPT") and ATTEMPT >= int(os.environ["FAULT_FROM_ATTEMPT"]):
    print(f"fault drill: cannot start in attempt {ATTEMPT}", flush=True)
    sys.exit(1)
sys.exit(main())
