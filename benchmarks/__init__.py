"""The benchmark's synthetic video-captioning task and its trained tiny Qwen2.5-VL pair.

    from hippo.benchmarks import load_pair
    target, draft, tokenizer = load_pair()   # verified against benchmarks/pair/checksums.json

Modules: task (videos, captions, metrics), narration (the long-answer task), tokenizer (word-level
tokenizer, chat template, processor inputs), models (configs), batching, train, narrate_train,
evaluate, narrate_eval, widen, pair (loading), measure, bench (`hippo bench`), regime and projection
(the bench's calibration and paper-hardware projection).
Nothing heavy is imported here, so `python -m hippo.benchmarks.train` can set OpenMP's wait policy first.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "load_pair":
        from hippo.benchmarks.pair import load_pair

        return load_pair
    raise AttributeError(name)


__all__ = ["load_pair"]
