"""Where a model's weights live: one device, or a target spread over several by a device map.

The paper's deployment shards a 72B target over three GPUs and puts the 7B draft on a fourth. A
target loaded with `from_pretrained(device_map=...)` (accelerate's named maps `auto`, `balanced`,
`balanced_low_0`, `sequential`, or a {module name: device} dict) has its input embedding on the first
device of the map and its output head on the last; accelerate's hooks move each module's inputs to
its device.

This module checks a map before anything loads (`resolve_device_map`: a name, a JSON file or a dict;
devices that exist; accelerate installed). How hippo then reads where a loaded model lives
(`input_device`, `output_device`, `model_devices`) is `hippo.placement`'s, re-exported here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from hippo.errors import ConfigError
from hippo.placement import input_device, model_devices, output_device  # noqa: F401 (re-exported)

#: accelerate's named device maps, as `from_pretrained(device_map=...)` takes them
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")

DeviceMap = str | dict[str, Any]


def check_device(device: str | None, what: str = "device", flag: str = "--device") -> None:
    """A device name torch knows, and CUDA only where it is available, up to the devices there are."""
    if not device:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{what} {device!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{what} {device!r} was asked for but CUDA is not available; use {flag} cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(
                f"{what} {device!r} does not exist: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise ConfigError(f"{what} {device!r} is not a device hippo runs a model on; use cpu or cuda:N")


def _map_device(module: str, value: Any) -> None:
    """One entry of a {module: device} map: an int (a CUDA index) or a device name that exists."""
    what = f"device map entry {module!r}:"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what} a device is a name like 'cuda:1' or 'cpu', or a GPU index; got {value!r}")
    if value in ("disk", "meta"):
        raise ConfigError(
            f"{what} {value!r} is not a device hippo decodes on (offloaded weights would be read on every "
            "step); map every module to cpu or cuda:N"
        )
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what} a GPU index is >= 0, got {value}")
        value = f"cuda:{value}"
    check_device(value, f"{what} device", "a map entry")


def need_accelerate(why: str) -> None:
    """transformers places modules by a device map through accelerate: say how to get it."""
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(
            f"{why} needs the accelerate package, which is not installed; "
            "pip install accelerate (or pip install 'hippo[multi-device]')"
        )


def resolve_device_map(
    value: DeviceMap | os.PathLike | None, flag: str = "target_device_map"
) -> DeviceMap | None:
    """A device map as `from_pretrained(device_map=...)` takes it: one of `DEVICE_MAPS`, or the
    {module name: device} dict given or read from a JSON file (any other string is taken for one).
    Every device must exist, and accelerate must be installed; raises ConfigError otherwise."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        if value in DEVICE_MAPS:
            need_accelerate(f"{flag} {value!r}")
            return value
        path = Path(value).expanduser()
        if not path.suffix == ".json" and not path.exists():
            raise ConfigError(
                f"{flag} {value!r} is neither a device map name ({', '.join(DEVICE_MAPS)}) nor a JSON "
                'file; pass one of the names or a file holding {"module name": "cuda:N", ...}'
            )
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{flag} file {value!r} cannot be read: {exc.strerror or exc}") from None
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{flag} file {value!r} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(
                f'{flag} file {str(path)!r} must hold a JSON object {{"module name": device}}, '
                f"got a {type(value).__name__}"
            )
    if not isinstance(value, dict):
        raise ConfigError(
            f"{flag} must be one of {', '.join(DEVICE_MAPS)}, a JSON file or a {{module: device}} dict; "
            f"got {value!r}"
        )
    if not value:
        raise ConfigError(f'{flag} is an empty map; name a device for each module ("" for the whole model)')
    for module, device in value.items():
        if not isinstance(module, str):
            raise ConfigError(f"{flag}: module names are strings, got {module!r}")
        _map_device(module, device)
    need_accelerate(f"{flag} (a {{module: device}} map)")
    return dict(value)


def draft_gpu_left_out(device_map: DeviceMap | None, draft_device: str | None) -> dict | None:
    """`max_memory` for `from_pretrained` that keeps a named map (auto, balanced, ...) off the draft's
    GPU, where there are other GPUs: the paper's layout, the target over cuda:0-2 and the draft alone
    on cuda:3, from `balanced` and `--draft-device cuda:3`. None where nothing is left out (a dict
    map places every module itself; a draft on the CPU; one GPU)."""
    if not isinstance(device_map, str) or not draft_device:
        return None
    dev = torch.device(draft_device)
    if dev.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    from accelerate.utils import get_max_memory

    memory = get_max_memory()  # {gpu index: free bytes, ..., "cpu": bytes}
    memory.pop(torch.cuda.current_device() if dev.index is None else dev.index, None)
    return memory
