"""Loading a committed pair with checksum verification: its target (widened at load time), draft and tokenizer.

    target, draft, tokenizer = load_pair()          # the narration pair, target widened (`hippo demo`)
    target, draft, tokenizer = load_pair(wide=False)  # the trained target as trained

A pair's folder holds target/ and draft/ (safetensors, config, tokenizer) and checksums.json: the
SHA-256 of every committed file, and of the widened target's weights, which `widen` rebuilds
deterministically at load time instead of being committed. `hippo.benchmarks.pair` writes it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration

from hippo.cli.pair.tokens import set_generation_defaults
from hippo.cli.pair.widen import weights_digest, widen

NARRATE_DIR = Path(__file__).parent / "narrate"  # the narration pair (the demo's and the benchmark's)
CHECKSUMS = "checksums.json"
MEASURED = "measured.json"  # figures measured on a pair (not part of it, so not checksummed)
#: how the narration pair's target is widened (k: residual/attention, m: MLP neurons per unit); a
#: pair's checksums.json records its own factors
NARRATE_WIDEN = {"k": 8, "m": 4}


class ChecksumError(RuntimeError):
    pass


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pair_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (CHECKSUMS, MEASURED))


def load_model(path: Path, dtype: torch.dtype) -> Qwen2_5_VLForConditionalGeneration:
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
    directory = Path(directory) if directory is not None else NARRATE_DIR
    sums = json.loads((directory / CHECKSUMS).read_text()) if verify else None
    if sums is not None:
        for path in pair_files(directory):
            rel = path.relative_to(directory).as_posix()
            if sums["files"].get(rel) != file_sha256(path):
                raise ChecksumError(
                    f"{rel} does not match {CHECKSUMS}; re-train or restore the committed file"
                )
        missing = set(sums["files"]) - {p.relative_to(directory).as_posix() for p in pair_files(directory)}
        if missing:
            raise ChecksumError(f"missing files of the pair: {sorted(missing)}")
    target = load_model(directory / "target", torch.float32)
    draft = load_model(directory / "draft", dtype)
    if wide:
        target = widen(target, **widening(directory))
        if sums is not None and weights_digest(target) != sums["widened_target"]["weights_sha256"]:
            raise ChecksumError("the widened target's weights differ from the recorded checksum")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory / "target")
    return target.to(dtype), draft, tokenizer


def widening(directory: Path) -> dict[str, int]:
    """The widening factors of a pair: recorded in its checksums.json, else the narration pair's."""
    sums = directory / CHECKSUMS
    if sums.is_file():
        w = json.loads(sums.read_text())["widened_target"]
        return {name: w[name] for name in ("k", "m", "kv") if name in w}
    return dict(NARRATE_WIDEN)
