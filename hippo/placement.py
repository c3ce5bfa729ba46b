"""Where a loaded model lives: the device its inputs go to, the device its logits come out on, and
every device holding its weights.

A target spread by a device map (`hippo.devices`) has its input embedding on the first device of the
map and its output head on the last; accelerate's hooks move each module's inputs to its device. hippo
therefore feeds a model's inputs to the device of its input embedding, takes its logits wherever they
come out, and compares the draft's tokens with the target's logits after moving one to the other:
never by a single `model.device`. Plain torch, no other hippo module, so the interfaces can ask it.
"""

from __future__ import annotations

import torch


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go: the device of its input embedding (the first device of a device
    map), else that of its first parameter."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return next(model.parameters()).device


def output_device(model: torch.nn.Module) -> torch.device:
    """Where the model's logits are made: the device of its output head (the last of a device map),
    else where its inputs go."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return input_device(model)


def model_devices(model: torch.nn.Module) -> tuple[torch.device, ...]:
    """Every device holding some of the model's weights, the input device first (one for a model not
    spread by a device map)."""
    first = input_device(model)
    seen = {first: None}
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "meta":
            seen.setdefault(t.device, None)
    return tuple(seen)
