"""The trained narration pair that `hippo demo` runs, shipped inside the package.

- `narrate/`: the target and draft checkpoints (safetensors, config, tokenizer) and checksums.json;
- `checkpoint`: loading them with checksum verification (`load_pair`), the target widened at load time;
- `widen`: the function-preserving widening of the target;
- `tokens`: the pair's special tokens and generate() defaults;
- `task`, `narration`: the synthetic clips the pair was trained on, from which the demo renders a
  held-out one.

`hippo.benchmarks` trains, evaluates and benches this pair (and its own captioning and LLaVA pairs)
on top of these modules.
"""
