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
NIAH_DIR = Path(__file__).parent / "pair_niah"  # the first long-video (needle-in-a-haystack) pair
#: the long-video pair of `hippo bench --long`: needle lists (`hippo.cli.pair.lists`), shaped like 72B/7B
LISTS_DIR = Path(__file__).parent / "pair_lists"
#: how each committed pair's target is widened (k: residual/attention, m: MLP neurons per unit)
WIDEN = {
    PAIR_DIR.name: {"k": 4, "m": 4},
    NARRATE_DIR.name: NARRATE_WIDEN,
    NIAH_DIR.name: {"k": 8, "m": 4},
    # 8 query heads share one key/value head (Qwen2.5-72B: 64 and 8), and the KV cache at 8k visual
    # tokens is 9.5% of a decode step's bytes (`docs/long-video.md`)
    LISTS_DIR.name: {"k": 4, "m": 16, "kv": 1},
}
#: how the long-video pair's draft is widened at load time (`hippo bench --long`), so
#: that it reads about 1/10 of the widened target's decoder weights and KV bytes per token
#: (`cost_ratios`: 9.2% and 9.4%), as a 7B draft does for a 72B target
DRAFT_WIDEN = {NIAH_DIR.name: {"k": 3, "m": 12}, LISTS_DIR.name: {"k": 2, "m": 27, "kv": 1}}


def decode_cost(model) -> dict[str, int]:
    """What one decode step reads: the language model's weights (decoder layers, final norm and
    lm_head; an embedding row is negligible) and the KV values cached per token."""
    t = model.config.text_config
    lm = model.model.language_model
    weights = sum(p.numel() for p in lm.layers.parameters()) + lm.norm.weight.numel()
    weights += model.lm_head.weight.numel()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return {"weights": weights, "kv_per_token": t.num_hidden_layers * 2 * t.num_key_value_heads * head_dim}


def prefill_flops(model, n: int) -> float:
    """FLOPs of a prefill over n visual tokens (the text is short): the vision encoder's linear layers
    on the 4 n patches, the language model's projections (2 x weights per token) and its causal
    attention (QK and PV: 4 x layers x query width x n^2 / 2)."""
    t = model.config.text_config
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    vision = sum(p.numel() for p in model.model.visual.parameters())
    linear = 2 * decode_cost(model)["weights"] * n + 2 * vision * 4 * n
    return linear + 4 * t.num_hidden_layers * t.num_attention_heads * head_dim * n * n / 2


def cost_ratios(target, draft) -> dict[str, float]:
    """The draft's decode cost over the target's (pass both as loaded for the benchmark: widened)."""
    a, b = decode_cost(draft), decode_cost(target)
    return {k: a[k] / b[k] for k in a}


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
