"""Checks on a checkpoint directory and a target/draft pair that need no model loaded.

`check_checkpoint` is what both `PipelineBuilder` (through `load_model`) and `hippo generate` run
before `from_pretrained`: a directory, a config.json, and weights whose safetensors headers parse and
whose declared sizes match the files (only the headers are read). `check_output` checks a file
the user asks to be written (--json, --timeline) before any work is done.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from hippo.errors import ConfigError, ModelError

WEIGHT_GLOBS = ("*.safetensors", "*.bin")
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def _restore(f: Path) -> str:
    return f"re-download the checkpoint or restore {f.name} from where it was saved"


def check_safetensors(f: Path) -> None:
    """The header parses and declares exactly the file's size (a truncated or corrupt file fails)."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise ModelError(
                f"weights file {str(f)!r} is truncated or corrupt (no valid header); {_restore(f)}"
            )
        try:
            header = json.loads(fh.read(n))
            end = max(
                (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ModelError(
                f"weights file {str(f)!r} is corrupt (its header does not parse); {_restore(f)}"
            ) from None
    if 8 + n + end != size:
        raise ModelError(
            f"weights file {str(f)!r} is truncated or corrupt: its header declares {8 + n + end} bytes but "
            f"the file has {size}; {_restore(f)}"
        )


def check_checkpoint(path: str | os.PathLike) -> Path:
    """A local checkpoint directory with a config.json and readable weights."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(
            f"checkpoint {str(p)!r} is not a directory; pass a local checkpoint directory or a model"
        )
    if not (p / "config.json").is_file():
        raise ModelError(f"checkpoint {str(p)!r} has no config.json; save it with save_pretrained()")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        raise ModelError(f"checkpoint {str(p)!r} has no weights (*.safetensors or *.bin)")
    for f in sorted(p.glob("*.safetensors")):
        check_safetensors(f)
    return p


def load_failed(path: str | os.PathLike, exc: BaseException) -> ModelError:
    """The error for a `from_pretrained` that failed on weights the header check let through."""
    first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return ModelError(
        f"could not load the weights of checkpoint {str(path)!r} ({first}); the weights files may be "
        "truncated or corrupt: re-download the checkpoint or restore them from where they were saved"
    )


def check_same_backbone(target: type, draft: type) -> None:
    """Draft and target must be the same backbone family (one adapter, one input layout)."""
    if target.name != draft.name:
        raise ModelError(
            f"the draft is a {draft.name} model but the target is a {target.name} model; the draft must "
            f"be a smaller model of the target's family: pass a {target.name} draft"
        )


def check_backbone_fits(cls: type, config: object, where: str, pm: object = None) -> None:
    """An explicit backbone must not contradict the adapter that claims the checkpoint's model_type."""
    from hippo.errors import PluginError
    from hippo.registry import resolve_adapter

    try:
        found = resolve_adapter(config, pm)
    except PluginError:  # a model type no adapter claims: the explicit backbone is the way to load it
        return
    if found.name != cls.name:
        raise ModelError(
            f"checkpoint {where!r} is a {found.name} model (model_type "
            f"{getattr(config, 'model_type', None)!r}), not {cls.name}; drop --backbone / backbone= "
            f"to detect it, or pass {found.name}"
        )


def check_output(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse an output file that cannot be written: a directory, or one in a missing directory."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory; pass a file name in it")
    if not p.resolve().parent.is_dir():
        raise ConfigError(
            f"{flag} {str(path)!r}: its directory does not exist; create it or choose another path"
        )
