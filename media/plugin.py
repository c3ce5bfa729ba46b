"""hippo.media's hook: `Pipeline.video_inputs` / `generate_from_video` read video files through it."""

from __future__ import annotations

from typing import Any

from hippo import hookimpl


@hookimpl(trylast=True)
def hippo_video_inputs(pipeline: Any, path: Any, prompt: str, options: dict[str, Any]) -> dict[str, Any]:
    from hippo.media.inputs import (
        check_tokenizers,
        has_tokenizer,
        load_tokenizer,
        load_video_inputs,
        model_dir,
    )

    tokenizer = options.get("tokenizer")
    if tokenizer is None and pipeline.draft_adapter is not None:
        # a draft checkpoint with its own tokenizer must tokenize exactly as the target's
        p_dir, q_dir = model_dir(pipeline.target), model_dir(pipeline.draft)
        if p_dir and q_dir and p_dir != q_dir and has_tokenizer(p_dir) and has_tokenizer(q_dir):
            tokenizer = load_tokenizer(p_dir)
            check_tokenizers(tokenizer, load_tokenizer(q_dir), p_dir, q_dir)
    return load_video_inputs(pipeline.target_adapter, path, prompt, **{**options, "tokenizer": tokenizer})
