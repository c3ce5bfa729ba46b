"""The committed benchmark pair: loading with checksum verification, and writing the checksum file.

    target, draft, tokenizer = load_pair()          # the widened target (the benchmark's cost regime)
    target, draft, tokenizer = load_pair(wide=False)  # the trained target as trained

benchmarks/pair/ holds target/ and draft/ (safetensors, config, tokenizer) and checksums.json:
the SHA-256 of every committed file, and of the widened target's weights, which `widen` rebuilds
deterministically at load time instead of being committed.

    python -m hippo.benchmarks.pair --write [--dir benchmarks/pair_narrate]   # record a pair's checksums
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration

from hippo.benchmarks.models import set_generation_defaults
from hippo.benchmarks.widen import weights_digest, widen

PAIR_DIR = Path(__file__).parent / "pair"  # the captioning pair
NARRATE_DIR = Path(__file__).parent / "pair_narrate"  # the narration pair (the benchmark's default)
CHECKSUMS = "checksums.json"
MEASURED = "measured.json"  # figures measured on a pair (not part of it, so not checksummed)
#: how each committed pair's target is widened (k: residual/attention, m: MLP neurons per unit)
WIDEN = {PAIR_DIR.name: {"k": 4, "m": 4}, NARRATE_DIR.name: {"k": 8, "m": 4}}


class ChecksumError(RuntimeError):
    pass


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (CHECKSUMS, MEASURED))


def _load(path: Path, dtype: torch.dtype) -> Qwen2_5_VLForConditionalGeneration:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    set_generation_defaults(model)
    return model


def load_pair(
    dtype: torch.dtype = torch.float32,
    *,
    wide: bool = True,
    directory: str | Path | None = None,
    verify: bool = True,
) -> tuple[Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, PreTrainedTokenizerFast]:
    """(target, draft, tokenizer). `wide`: the target widened by `widen` (same outputs, ~13x the
    decode work). `verify` checks every file and the widened weights against checksums.json."""
    directory = Path(directory) if directory is not None else PAIR_DIR
    sums = json.loads((directory / CHECKSUMS).read_text()) if verify else None
    if sums is not None:
        for path in _files(directory):
            rel = path.relative_to(directory).as_posix()
            if sums["files"].get(rel) != file_sha256(path):
                raise ChecksumError(
                    f"{rel} does not match {CHECKSUMS}; re-train or restore the committed file"
                )
        missing = set(sums["files"]) - {p.relative_to(directory).as_posix() for p in _files(directory)}
        if missing:
            raise ChecksumError(f"missing files of the pair: {sorted(missing)}")
    target = _load(directory / "target", torch.float32)
    draft = _load(directory / "draft", dtype)
    if wide:
        target = widen(target, **widening(directory))
        if sums is not None and weights_digest(target) != sums["widened_target"]["weights_sha256"]:
            raise ChecksumError("the widened target's weights differ from the recorded checksum")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory / "target")
    return target.to(dtype), draft, tokenizer


def widening(directory: Path) -> dict[str, int]:
    """The widening factors of a pair: recorded in its checksums.json, else by its folder's name."""
    sums = directory / CHECKSUMS
    if sums.is_file():
        w = json.loads(sums.read_text())["widened_target"]
        return {"k": w["k"], "m": w["m"]}
    return WIDEN.get(directory.name, WIDEN[NARRATE_DIR.name])


def write_checksums(directory: Path = PAIR_DIR) -> dict:
    target = _load(directory / "target", torch.float32)
    factors = WIDEN.get(directory.name, WIDEN[NARRATE_DIR.name])
    sums = {
        "files": {p.relative_to(directory).as_posix(): file_sha256(p) for p in _files(directory)},
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
