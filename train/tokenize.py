"""Turns a text file into a token file for `--data.path`: `python -m train.tokenize input.txt output.bin`.

The tokenizer is UTF-8 bytes (ids 0-255, so `model.vocab_size` >= 256): it ships with Python, needs no
download, and round-trips any text. Output: a flat little-endian uint16 array, as nanoGPT writes.
"""

import argparse
import sys
from pathlib import Path

import numpy as np


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype("<u2")


def decode(tokens: np.ndarray) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.tokenize", description=__doc__)
    parser.add_argument("input", type=Path, help="UTF-8 text file")
    parser.add_argument("output", type=Path, help="token file to write (.bin)")
    args = parser.parse_args(argv)
    try:
        tokens = encode(args.input.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        print(f"train.tokenize: {args.input}: {err}", file=sys.stderr)
        return 1
    tmp = args.output.with_name(args.output.name + ".tmp")
    tokens.tofile(tmp)
    tmp.replace(args.output)
    print(f"train.tokenize: {len(tokens):,} tokens -> {args.output} (uint16, vocab 256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
