"""Registry discovery, tiny float64 models, and prompts (no hypothesis needed).

Adapters, schedulers, selectors and scorers come from the registries, so a backbone or a part added
later, a third party's included, is covered without touching the tests. Notation: p = target,
q = draft, γ = draft length, V = vocabulary size, L = prompt length.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from hippo.registry import lookup, registry

DTYPE = torch.float64

# ---- discovery ----------------------------------------------------------------------------------


def names(kind: str) -> list[str]:
    """Registered names of one plugin kind ('adapters', 'schedulers', ...), sorted."""
    return sorted(registry(kind))


def part_class(kind: str, name: str) -> type:
    return lookup(kind, name)


def config_fields(cls: type) -> set[str]:
    config = getattr(cls, "Config", None)
    return {a.name for a in attrs.fields(config)} if config is not None and attrs.has(config) else set()


def required_options(cls: type) -> list[str]:
    """Options of a part's Config that have no default (the part cannot be built without them)."""
    config = getattr(cls, "Config", None)
    if config is None or not attrs.has(config):
        return []
    return [a.name for a in attrs.fields(config) if a.default is attrs.NOTHING]


def options_for(kind: str, name: str, **candidates: Any) -> dict[str, Any]:
    """The candidate options that the part's attrs Config actually has (e.g. keep_ratio, gamma, seed)."""
    fields = config_fields(part_class(kind, name))
    return {k: v for k, v in candidates.items() if k in fields and v is not None}


def executor_choices(scheduler: str) -> list[dict | None]:
    """In-process ways to run a scheduler's draft: None for a scheduler without executors, else
    one after the other, and overlapped on a thread (the CUDA-stream path of `inline`)."""
    if "executor" not in config_fields(part_class("schedulers", scheduler)):
        return [None]
    thread = {"executor": "inline", "executor_options": {"overlap": "thread"}}
    return [{"executor": "inline", "executor_options": {"overlap": "off"}}, thread]


def drafting_schedulers() -> list[str]:
    return [n for n in names("schedulers") if part_class("schedulers", n).needs_draft]


def selector_scorer_pairs() -> list[tuple[str, str | None]]:
    """Every selector, each scored one paired with every registered scorer (see
    `hippo.testing.reference.supported_pairs` for those an adapter runs)."""
    scorers = names("scorers")
    pairs: list[tuple[str, str | None]] = []
    for sel in names("selectors"):
        if part_class("selectors", sel).needs_scores:
            pairs.extend((sel, sc) for sc in scorers)
        else:
            pairs.append((sel, None))
    return pairs


# ---- tiny models --------------------------------------------------------------------------------

_MODELS: dict[tuple[str, str, int, torch.dtype], Any] = {}


def tiny(adapter: str, role: str = "target", seed: int = 0, dtype: torch.dtype = DTYPE) -> Any:
    """The adapter's tiny random model (float64 unless `dtype` says otherwise), built once per process.

    Float64 makes greedy equality exact; float32 is the dtype where hippo's packed linear weights
    (`hippo.packed`, the target's default path) are live. Raises NotImplementedError for adapters
    that ship no tiny model (see `tiny_adapters`).
    """
    key = (adapter, role, seed, dtype)
    if key not in _MODELS:
        model = part_class("adapters", adapter).tiny_model(role, seed=seed, dtype=dtype)
        _MODELS[key] = model.eval()
    return _MODELS[key]


#: how much a "flat" draft scales the target's logits (`flat_draft`)
FLAT_SCALE = 0.5


def flat_draft(adapter: str, seed: int = 0, dtype: torch.dtype = DTYPE) -> Any:
    """A draft whose q is flatter than p: a copy of the tiny target with its output layer scaled by
    `FLAT_SCALE` (so its logits are), built once per process. At the target's temperature q then
    puts real mass on tokens p rarely emits, while it still ranks them as p does: first children
    are often rejected, and the residual and the siblings' rule are used on most rounds."""
    key = (adapter, "flat", seed, dtype)
    if key not in _MODELS:
        model = copy.deepcopy(tiny(adapter, "target", seed, dtype))
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach() * FLAT_SCALE, requires_grad=False)
        if getattr(head, "bias", None) is not None:
            head.bias = torch.nn.Parameter(head.bias.detach() * FLAT_SCALE, requires_grad=False)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def has_tiny(adapter: str) -> bool:
    return getattr(part_class("adapters", adapter), "tiny_module", None) is not None


def tiny_adapters() -> list[str]:
    """Registered adapters that provide a tiny model (`Adapter.tiny_module`), sorted."""
    return [a for a in names("adapters") if has_tiny(a)]


def vocab_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _ints(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def eos_ids(model: Any) -> list[int]:
    return _ints(model.generation_config.eos_token_id)


def special_ids(model: Any) -> set[int]:
    """Every id named `*_token_id` in the model's configs: BOS/EOS/pad, vision placeholders..."""
    configs = [model.config, model.generation_config]
    text = getattr(model.config, "get_text_config", None)
    if text is not None:
        configs.append(text())
    out: set[int] = set()
    for cfg in configs:
        for key, value in cfg.to_dict().items():
            if key.endswith("_token_id") or key.endswith("_token_index"):
                out.update(_ints(value))
    return out


def text_ids(model: Any) -> list[int]:
    """Ordinary text tokens: the vocabulary minus every special id."""
    special = special_ids(model)
    return [i for i in range(vocab_size(model)) if i not in special]


def pixel_unit(model: Any) -> int:
    """The side, in pixels, of one visual token before pruning: patch x spatial merge.

    28 for Qwen2.5-VL (14 x 2), 32 for Qwen3-VL (16 x 2); backbones that resize frames accept any
    multiple of their patch size.
    """
    vc = model.config.vision_config
    return int(vc.patch_size) * int(getattr(vc, "spatial_merge_size", 1) or 1)


# ---- prompts ------------------------------------------------------------------------------------


def make_video(t: int, h: int, w: int, seed: int) -> torch.Tensor:  # -> [T, H, W, 3] in [0, 1]
    return torch.rand(t, h, w, 3, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _is64(value: Any) -> bool:
    return torch.is_tensor(value) and value.dtype == torch.float64


class Prompt:
    """One video between two runs of text ids; `inputs` is the processor-shaped dict."""

    def __init__(self, adapter: str, model: Any, grid: tuple[int, int, int], video_seed: int, before, after):
        self.adapter, self.grid, self.video_seed = adapter, tuple(grid), video_seed
        self.before, self.after = tuple(before), tuple(after)
        video = make_video(*grid, video_seed)  # [T, H, W, 3]
        inputs = part_class("adapters", adapter).synthetic_inputs(model, video, list(before), list(after))
        if model.dtype != DTYPE:  # a float32 model (packed weights) gets float32 pixels, not float64
            inputs = {k: v.to(model.dtype) if _is64(v) else v for k, v in inputs.items()}
        self.inputs = inputs

    @classmethod
    def default(cls, adapter: str, model: Any, frames: int = 2) -> Prompt:
        """A fixed small prompt: `frames` frames of 2x2 visual units, a few text tokens around them."""
        unit, words = pixel_unit(model), text_ids(model)
        return cls(adapter, model, (frames, 2 * unit, 2 * unit), 0, words[10:13], words[20:22])

    @property
    def length(self) -> int:
        return int(self.inputs["input_ids"].shape[1])

    def __repr__(self) -> str:  # hypothesis prints this for a falsifying example: no tensors
        return (
            f"Prompt({self.adapter!r}, grid={self.grid}, video_seed={self.video_seed}, "
            f"before={list(self.before)}, after={list(self.after)}, length={self.length})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))
