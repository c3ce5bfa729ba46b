"""Host reads: the CPU stand-in for a GPU's syncs, counted.

On a GPU every read of a tensor's value by the host (`.item()`, `.tolist()`, `bool(t)`, `int(t)`,
`torch.equal`) and every op whose output shape depends on values (`nonzero`, boolean indexing,
`masked_select`, `unique`, `repeat_interleave` without a size) waits for the device. On a CPU they
cost nothing, so nothing shows them; `HostReads` counts them instead: a `TorchDispatchMode` sees the
aten ops they reach (`_local_scalar_dense` for the scalar reads), and `Tensor.tolist`, which reads
without dispatching, is wrapped. Work inside the models' own forwards is left out (a forward's own
syncs are the backbone's, not the round's): any `nn.Module`'s forward pauses the count.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: aten ops that read a value to the host, or whose output's shape depends on values
READS = {
    aten._local_scalar_dense.default: "item/bool/int",
    aten.equal.default: "equal",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.repeat_interleave.Tensor: "repeat_interleave",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique",
}


class HostReads(TorchDispatchMode):
    """Count host reads while active: `with HostReads() as reads: ...; reads.count`. `reads.kinds`
    says which (a Counter); `reads.paused` > 0 inside a module's forward."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.kinds: Counter[str] = Counter()
        #: with `where=True`: reads by the innermost hippo line that made them ("path:line function")
        self.sites: Counter[str] | None = Counter() if where else None
        self._local = threading.local()  # a forward pauses the count in its own thread only
        self._hooks: list[Any] = []
        self._tolist = None

    @property
    def paused(self) -> int:
        """Module forwards this thread is inside (> 0: its reads are the backbone's, not counted)."""
        return getattr(self._local, "depth", 0)

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    def _add(self, kind: str) -> None:
        if not self.paused:
            self.kinds[kind] += 1
            if self.sites is not None:
                self.sites[_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = READS.get(func)
        if kind is None and func is aten.index.Tensor:  # boolean-mask indexing: a nonzero inside
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                kind = "boolean index"
        if kind is not None:
            self._add(kind)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        reads, tolist = self, torch.Tensor.tolist

        def counted(t: torch.Tensor) -> Any:
            reads._add("tolist")
            return tolist(t)

        def pause(*_: Any) -> None:
            reads._local.depth = reads.paused + 1

        def resume(*_: Any) -> None:
            reads._local.depth = reads.paused - 1

        self._tolist, torch.Tensor.tolist = tolist, counted
        modules = torch.nn.modules.module
        self._hooks = [
            modules.register_module_forward_pre_hook(pause),
            modules.register_module_forward_hook(resume),
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)


_HERE = __file__.replace("\\", "/")


def _site() -> str:
    """The innermost frame in hippo's own code (this module left out)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/hippo/" in path or "/plugins/" in path or "/adapters/" in path:
            if not path.endswith("syncs.py"):
                return f"{'/'.join(path.split('/')[-2:])}:{frame.lineno} {frame.name}"
    return "elsewhere"
