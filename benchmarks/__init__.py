"""The benchmark's synthetic video-captioning task and its trained tiny Qwen2.5-VL pair.

    from hippo.benchmarks import load_pair
    from hippo.benchmarks.pair import PAIR_DIR
    target, draft, tokenizer = load_pair(directory=PAIR_DIR)  # verified against its checksums.json

The task (`hippo.cli.pair.task`: videos, captions, metrics), the narration task
(`hippo.cli.pair.narration`), the narration pair, its loader and the widening (`hippo.cli.pair`) ship
with `hippo demo`; this package builds on them. Modules: tokenizer (word-level tokenizer, chat
template, processor inputs), models (configs), batching, train, narrate_train, evaluate,
narrate_eval, pair (where the pairs are, their checksums), measure, bench (`hippo bench`), regime
and projection (the bench's calibration and paper-hardware projection).
Nothing heavy is imported here, so `python -m hippo.benchmarks.train` can set OpenMP's wait policy first.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "load_pair":
        from hippo.cli.pair.checkpoint import load_pair

        return load_pair
    raise AttributeError(name)


__all__ = ["load_pair"]
