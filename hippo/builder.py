"""PipelineBuilder: names from the registries plus options -> a validated Pipeline.

    pipe = (hippo.PipelineBuilder()
            .target("path/to/target").draft("path/to/draft")
            .selector("uniform", keep_ratio=0.1)
            .scheduler("serial", gamma=5)
            .build())

The same choices can be written down as one `PipelineConfig`, a dict, or a JSON/TOML file and passed
to `PipelineBuilder.from_config`.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from hippo.checkpoint import check_backbone_fits, check_checkpoint, check_same_backbone, load_failed
from hippo.devices import (
    DeviceMap,
    check_device,
    draft_gpu_left_out,
    model_devices,
    resolve_device_map,
)
from hippo.errors import ConfigError, ModelError
from hippo.interfaces import Adapter, make_config
from hippo.packed import MAX_ROWS
from hippo.pipeline import Pipeline
from hippo.registry import lookup, plugin_manager, resolve_adapter
from hippo.sampling import check_vocab
from hippo.session import PackedSessions
from hippo.static import ROLES, StaticSessions

KINDS = ("scorer", "selector", "drafter", "verifier", "scheduler")


def _part(value: Any) -> PartSpec | None:
    if value is None or isinstance(value, PartSpec):
        return value
    if isinstance(value, str):
        return PartSpec(value)
    if isinstance(value, dict):
        d = dict(value)
        if "name" not in d:
            raise ConfigError(f"a part given as a dict needs a 'name' key, got {value!r}")
        return PartSpec(d.pop("name"), d.pop("options", None) or d)
    raise ConfigError(f"a part must be a name, a dict with 'name', or None; got {value!r}")


@attrs.frozen
class PartSpec:
    """A registry name plus the options for that plugin's attrs config."""

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    options: dict = attrs.field(factory=dict, converter=lambda d: dict(d or {}))


def _optional_str(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{attr.name} must be a device name like 'cuda:1' or 'cpu', got {value!r}")


def _device_map_value(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, (str, dict)):
        raise ConfigError(
            f"{attr.name} must be a map name (auto, balanced, ...), a JSON file name or a "
            f"{{module: device}} table; got {value!r}"
        )


@attrs.frozen
class PipelineConfig:
    """A whole pipeline as data. `target`/`draft` are checkpoint paths (or None to set them in code)."""

    target: str | None = None
    draft: str | None = None
    backbone: str = "auto"
    scorer: PartSpec | None = attrs.field(default=None, converter=_part)
    selector: PartSpec = attrs.field(
        factory=lambda: PartSpec("uniform", {"keep_ratio": 0.1}), converter=_part
    )
    drafter: PartSpec = attrs.field(factory=lambda: PartSpec("chain"), converter=_part)
    verifier: PartSpec | None = attrs.field(default=None, converter=_part)
    scheduler: PartSpec = attrs.field(factory=lambda: PartSpec("auto"), converter=_part)
    dtype: str | None = None
    #: both models' device (cpu, cuda, cuda:N); None: where the weights load
    device: str | None = attrs.field(default=None, validator=_optional_str)
    #: the target spread over devices: an accelerate map name (auto, balanced, balanced_low_0,
    #: sequential), a JSON file of {module: device}, or that dict; not together with `device`
    target_device_map: str | dict | None = attrs.field(default=None, validator=_device_map_value)
    #: the draft's own device (default: `device`)
    draft_device: str | None = attrs.field(default=None, validator=_optional_str)
    #: static-cache compiled sessions: `{"roles": ["target"], "mode": "inductor"}` (None: off)
    compile: dict | None = None
    #: packed linear weights for few-token forwards: `{"roles": ["target"], "max_rows": 64}`
    #: (None: the builder's default, the target's; `{"roles": []}`: off)
    pack: dict | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        return make_config(cls, dict(data), owner="pipeline config")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> PipelineConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        text = p.read_text()
        try:
            if p.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(
                f"config file {str(p)!r} is not valid {p.suffix.lstrip('.') or 'JSON'}: {exc}"
            ) from exc
        return cls.from_dict(data)


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def load_model(
    path: str | os.PathLike, backbone: str = "auto", **kwargs: Any
) -> tuple[torch.nn.Module, type]:
    """Load a checkpoint directory with `from_pretrained`, choosing the adapter by its config."""
    from transformers import AutoConfig

    p = check_checkpoint(path)
    pm = plugin_manager()  # adapter plugins may register their config classes with AutoConfig
    config = AutoConfig.from_pretrained(p)
    if backbone == "auto":
        cls = resolve_adapter(config, pm)
    else:
        cls = lookup("adapters", backbone, pm)
        check_backbone_fits(cls, config, str(p), pm)
    try:
        return cls.load(str(p), **kwargs), cls
    except (EOFError, pickle.UnpicklingError) as exc:
        raise load_failed(p, exc) from exc
    except Exception as exc:
        if type(exc).__name__ == "SafetensorError":  # safetensors' own type, not an OSError
            raise load_failed(p, exc) from exc
        if not isinstance(exc, (OSError, ValueError, RuntimeError)):
            raise
        raise ModelError(f"could not load checkpoint {str(p)!r} with {cls.__name__}: {exc}") from exc


def _session_table(name: str, table: Any, method: Any, roles: Sequence[str], keys: Sequence[str]) -> None:
    """Apply a pipeline config's `compile` or `pack` table (`roles` plus the method's options)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{name} must be a table like {{roles = ['target']}}, got {table!r}")
    unknown = sorted(set(table) - {"roles", *keys})
    if unknown:
        raise ConfigError(f"{name} does not take {unknown}; it takes roles, {', '.join(keys)}")
    chosen = table.get("roles", roles)
    method(*([chosen] if isinstance(chosen, str) else chosen), **{k: table[k] for k in keys if k in table})


class PipelineBuilder:
    def __init__(self, pm: Any = None):
        self._pm = pm
        self._models: dict[str, Any] = {"target": None, "draft": None}
        self._adapters: dict[str, str | None] = {"target": None, "draft": None}
        self._load_kwargs: dict[str, dict] = {"target": {}, "draft": {}}
        self._adapter_options: dict[str, dict] = {"target": {}, "draft": {}}
        self._parts: dict[str, Any] = {}
        self._specs: dict[str, PartSpec | None] = {}
        self._device: str | None = None
        self._target_device_map: DeviceMap | None = None
        self._draft_device: str | None = None
        self._static: dict[str, StaticSessions | None] = {"target": None, "draft": None}
        self._packed: dict[str, PackedSessions | None] = {"target": PackedSessions(), "draft": None}
        defaults = PipelineConfig()
        for kind in KINDS:
            self._set(kind, getattr(defaults, kind))

    # ---- models -----------------------------------------------------------------------------
    def target(
        self,
        model: Any,
        *,
        backbone: str | None = None,
        adapter_options: dict | None = None,
        **load_kwargs: Any,
    ) -> PipelineBuilder:
        """The model whose output hippo reproduces: a transformers model or a checkpoint path.

        `backbone` names the adapter (default: detected from the config), `adapter_options` go to
        the adapter (e.g. `{"positions": "compact"}` for LLaVA-OneVision), and `load_kwargs` to
        `from_pretrained`.
        """
        return self._model("target", model, backbone, adapter_options, load_kwargs)

    def draft(
        self,
        model: Any,
        *,
        backbone: str | None = None,
        adapter_options: dict | None = None,
        **load_kwargs: Any,
    ) -> PipelineBuilder:
        """The drafting model: a smaller model of the same family, a path, or the target itself."""
        return self._model("draft", model, backbone, adapter_options, load_kwargs)

    def _model(
        self, role: str, model: Any, backbone: str | None, options: dict | None, load_kwargs: dict
    ) -> PipelineBuilder:
        if model is None:
            raise ConfigError(f"{role} must be a model or a checkpoint path, got None")
        self._models[role] = model
        self._adapters[role] = backbone
        self._adapter_options[role] = dict(options or {})
        self._load_kwargs[role] = load_kwargs
        return self

    # ---- parts ------------------------------------------------------------------------------
    def scorer(self, name: str | None, **options: Any) -> PipelineBuilder:
        return self._set("scorer", None if name is None else PartSpec(name, options))

    def selector(self, name: str, **options: Any) -> PipelineBuilder:
        return self._set("selector", PartSpec(name, options))

    def drafter(self, name: str, **options: Any) -> PipelineBuilder:
        return self._set("drafter", PartSpec(name, options))

    def verifier(self, name: str | None, **options: Any) -> PipelineBuilder:
        """'greedy', 'rejection', or None (the default: chosen from do_sample at generate time)."""
        return self._set("verifier", None if name is None or name == "auto" else PartSpec(name, options))

    def scheduler(self, name: str, **options: Any) -> PipelineBuilder:
        return self._set("scheduler", PartSpec(name, options))

    def _set(self, kind: str, spec: PartSpec | None) -> PipelineBuilder:
        """Look the name up and validate its options now, so a bad value fails before any model loads."""
        if spec is None:
            self._specs[kind], self._parts[kind] = None, None
            return self
        cls = lookup(kind + "s", spec.name, self._pm)
        try:
            part = cls.from_options(**spec.options)
        except ConfigError as exc:
            raise ConfigError(f"{kind} {spec.name!r}: {exc}") from exc
        self._specs[kind], self._parts[kind] = spec, part
        return self

    # ---- config files -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: PipelineConfig | dict | str | os.PathLike) -> PipelineBuilder:
        if isinstance(config, (str, os.PathLike)):
            config = PipelineConfig.from_file(config)
        elif isinstance(config, dict):
            config = PipelineConfig.from_dict(config)
        b = cls()
        for kind in KINDS:
            b._set(kind, getattr(config, kind))
        load = {}
        if config.dtype:
            if config.dtype not in _DTYPES:
                raise ConfigError(f"dtype {config.dtype!r} is not one of {', '.join(_DTYPES)}")
            load["dtype"] = _DTYPES[config.dtype]
        backbone = None if config.backbone == "auto" else config.backbone
        if config.target:
            b.target(config.target, backbone=backbone, **load)
        if config.draft:
            b.draft(config.draft, backbone=backbone, **load)
        b.devices(config.device, target_device_map=config.target_device_map, draft_device=config.draft_device)
        if config.compile is not None:
            _session_table("compile", config.compile, b.compile, ROLES, ("mode", "headroom"))
        if config.pack is not None:
            _session_table("pack", config.pack, b.pack, ("target",), ("max_rows",))
        return b

    # ---- devices ----------------------------------------------------------------------------
    def devices(
        self,
        device: str | None = None,
        *,
        target_device_map: DeviceMap | os.PathLike | None = None,
        draft_device: str | None = None,
    ) -> PipelineBuilder:
        """Where the models run: `device` for both (cpu, cuda, cuda:N), or the target spread over
        several devices by `target_device_map` (accelerate's `auto`, `balanced`, `balanced_low_0`,
        `sequential`, a JSON file or a {module: device} dict, given to `from_pretrained`) and the
        draft on `draft_device` (default: `device`). Checked now: devices that exist, a readable
        map, accelerate installed for a map, and not `device` and a target map together."""
        if device is not None and target_device_map is not None:
            raise ConfigError(
                f"device {device!r} and target_device_map both place the target (--device, "
                "--target-device-map); give the target a map and the draft --draft-device instead"
            )
        check_device(device)
        check_device(draft_device, "draft device", "--draft-device")
        self._device = device
        self._target_device_map = resolve_device_map(target_device_map)
        self._draft_device = draft_device
        return self

    # ---- sessions ---------------------------------------------------------------------------
    def compile(self, *roles: str, mode: str = "inductor", headroom: int = 64) -> PipelineBuilder:
        """Run the roles' decoding ("target", "draft"; both if none named) on a static KV cache
        with a compiled forward (`hippo.static`); `mode="eager"` keeps the static cache uncompiled."""
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ConfigError(f"compile roles must be among {', '.join(ROLES)}; got {sorted(unknown)}")
        kind = StaticSessions(mode=mode, headroom=headroom)
        for role in roles or ROLES:
            self._static[role] = kind
        return self

    def pack(self, *roles: str, max_rows: int = MAX_ROWS) -> PipelineBuilder:
        """Run exactly these roles' forwards of up to `max_rows` tokens (steps, verifications,
        catch-ups) and their prefills on oneDNN-packed linear weights (`hippo.packed`; CPU fp32, inert elsewhere). The target is
        packed by default; `.pack()` with no role turns packing off, `.pack("target", "draft")`
        packs both."""
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ConfigError(f"pack roles must be among {', '.join(ROLES)}; got {sorted(unknown)}")
        kind = PackedSessions(max_rows=max_rows)
        self._packed = {role: kind if role in roles else None for role in ROLES}
        return self

    # ---- build ------------------------------------------------------------------------------
    def _adapter(self, role: str) -> Adapter:
        model, backbone = self._models[role], self._adapters[role]
        device_map = self._target_device_map if role == "target" else None
        if device_map is not None and not isinstance(model, (str, os.PathLike)):
            raise ConfigError(
                "target_device_map places a target loaded from a checkpoint path; pass the path, or "
                "load the model with from_pretrained(device_map=...) yourself and pass it"
            )
        if isinstance(model, (str, os.PathLike)):
            kwargs = dict(self._load_kwargs[role])
            if device_map is not None:
                if "device_map" in kwargs:
                    raise ConfigError("the target has a device_map keyword and a target_device_map; give one")
                kwargs["device_map"] = device_map
                left_out = draft_gpu_left_out(device_map, self._draft_device)
                if left_out is not None and "max_memory" not in kwargs:
                    kwargs["max_memory"] = left_out
            model, cls = load_model(model, backbone or "auto", **kwargs)
        elif isinstance(model, torch.nn.Module):
            cls = (
                lookup("adapters", backbone, self._pm)
                if backbone
                else resolve_adapter(model.config, self._pm)
            )
        else:
            raise ConfigError(
                f"{role} must be a transformers model or a checkpoint path, got {type(model).__name__}"
            )
        device = (self._draft_device or self._device) if role == "draft" else self._device
        if device and device_map is None:
            check_device(device)
            model = model.to(device)
        model.eval()
        try:
            return cls(model, **self._adapter_options[role])
        except TypeError as exc:
            raise ConfigError(
                f"{role} adapter {cls.name!r} does not take options {self._adapter_options[role]}: {exc}"
            ) from exc

    def build(self) -> Pipeline:
        if self._models["target"] is None:
            raise ConfigError("no target model: call .target(model_or_path) before .build()")
        scheduler = self._parts["scheduler"]
        target = self._adapter("target")
        draft = None
        if scheduler.needs_draft:
            if self._models["draft"] is None:
                raise ConfigError(
                    f"scheduler {self._specs['scheduler'].name!r} needs a draft model: call .draft(...) "
                    "(pass the target itself for self-speculation)"
                )
            same = self._models["draft"] is self._models["target"] and not self._adapter_options["draft"]
            if (
                same
                and self._draft_device
                and {torch.device(self._draft_device)} != set(model_devices(target.model))
            ):
                raise ConfigError(
                    f"the draft is the target itself (self-speculation), which cannot also run on "
                    f"draft device {self._draft_device!r}; drop --draft-device or pass a draft checkpoint"
                )
            draft = target if same else self._adapter("draft")
            if type(draft.model) is not type(target.model):  # a draft's adapter may specialise the target's
                check_same_backbone(type(target), type(draft))
            check_vocab(target.vocab_size(), draft.vocab_size())
        selector, scorer = self._parts["selector"], self._parts["scorer"]
        if selector.needs_scores and scorer is None:
            raise ConfigError(
                f"selector {self._specs['selector'].name!r} ranks tokens by score: add a scorer, "
                "e.g. .scorer('holistic')"
            )
        spread = model_devices(target.model)
        if self._static["target"] is not None and len(spread) > 1:
            raise ConfigError(
                f"compiled static-cache sessions run on one device, but the target is spread over "
                f"{', '.join(map(str, spread))}; compile only the draft (compile roles ['draft'])"
            )
        names = {k: (s.name if s else "auto") for k, s in self._specs.items()}
        sessions = {
            role: self._static[role] if packed is None else attrs.evolve(packed, then=self._static[role])
            for role, packed in self._packed.items()
        }
        drafter, verifier = self._parts["drafter"], self._parts["verifier"]
        return Pipeline(target, draft, scorer, selector, drafter, verifier, scheduler, names, sessions)
