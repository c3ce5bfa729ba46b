"""The benchmark's committed pairs: where they are, and writing their checksum files.

benchmarks/pair/ holds the captioning pair, benchmarks/pair_niah/ the long-video pair; the narration pair ships with `hippo demo` in
`hippo.cli/pair/narrate/` (`hippo.cli.pair.checkpoint.NARRATE_DIR`). Both load with
`hippo.cli.pair.checkpoint.load_pair(directory=...)`, which checks them against their checksums.json.

    python -m hippo.benchmarks.pair --write [--dir cli/pair/narrate]   # record a pair's checksums
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hippo.cli.pair.checkpoint import (
    CHECKSUMS,
    NARRATE_DIR,
    NARRATE_WIDEN,
    file_sha256,
    load_model,
    load_pair,
    pair_files,
)
from hippo.cli.pair.widen import weights_digest, widen

PAIR_DIR = Path(__file__).parent / "pair"  # the captioning pair
NIAH_DIR = Path(__file__).parent / "pair_niah"  # the long-video (needle-in-a-haystack) pair
#: how each committed pair's target is widened (k: residual/attention, m: MLP neurons per unit)
WIDEN = {PAIR_DIR.name: {"k": 4, "m": 4}, NARRATE_DIR.name: NARRATE_WIDEN, NIAH_DIR.name: {"k": 8, "m": 4}}


def write_checksums(directory: Path = PAIR_DIR) -> dict:
    target = load_model(directory / "target", torch.float32)
    factors = WIDEN.get(directory.name, NARRATE_WIDEN)
    sums = {
        "files": {p.relative_to(directory).as_posix(): file_sha256(p) for p in pair_files(directory)},
        "widened_target": {**factors, "weights_sha256": weights_digest(widen(target, **factors))},
    }
    (directory / CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n")
    return sums


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="record the checksums of the files in pair/")
    p.add_argument("--dir", type=Path, default=PAIR_DIR)
    args = p.parse_args(argv)
    if args.write:
        print(json.dumps(write_checksums(args.dir), indent=1))
    else:
        load_pair(directory=args.dir)
        print("checksums OK")


if __name__ == "__main__":
    main()
