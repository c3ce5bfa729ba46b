"""hippo.testing: prove a pipeline, or a plugin part, lossless.

Install with `pip install 'hippo[testing]'` (it needs hypothesis). The ten-line test:

    from hippo.testing import assert_greedy_lossless

    def test_my_scheduler_is_lossless():
        assert_greedy_lossless(lambda case: case.builder(scheduler="my_scheduler"))

`case` is a hypothesis-drawn `Case`: a tiny float64 target/draft pair of a registered adapter, a
video and prompt, γ, a keep ratio, decode settings, draft positions to corrupt, simulated timings.
A counterexample raises `LosslessViolation`, whose `report` is the shrunk case, the first differing
position, both tokens and a one-line reproduction. From the shell: `hippo check NAME`.

Modules: `models` (registry discovery, tiny models, prompts), `strategies` (hypothesis strategies),
`case` (`Case`), `drafters` (the corrupting drafter), `reference` (target.generate, exact laws),
`report`, `greedy` and `sampling` (the checks), `power` (the law check's statistics and power:
`python -m hippo.testing.sampling`), `planted` (seven planted sampling bugs the law check must catch),
`coupled` (a path that promises a law-checked reference's draws, seed by seed), `matrix` (the
planted bugs × the paths that sample: `python -m hippo.testing.matrix`),
`plugin_check` (`hippo check`), `pytest_plugin`.

Names are loaded lazily, so that the pytest plugin (registered for every pytest run once hippo is
installed) costs nothing and does not need hypothesis until a check is used.

Notation: p = target, q = draft, γ = draft length.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    # checks
    "assert_greedy_lossless": "greedy",
    "replay_greedy": "greedy",
    "GreedyResult": "greedy",
    "assert_sampling_exact": "sampling",
    "SamplingResult": "sampling",
    "LawCheck": "sampling",
    "assert_same_draws": "coupled",
    "CoupledResult": "coupled",
    "assert_conversation_lossless": "conversation",
    # the case and its strategies
    "Case": "case",
    "cases": "strategies",
    "strategies": None,
    # failure reports
    "LosslessViolation": "report",
    "Report": "report",
    # tiny models and registry discovery
    "tiny": "models",
    "tiny_adapters": "models",
    "Prompt": "models",
    # the corrupting drafter
    "CorruptingDrafter": "drafters",
    "corrupting_plugin": "drafters",
    # planted sampling bugs
    "PLANTED": "planted",
    "planted_plugin": "planted",
    "planted_build": "planted",
    # hippo check
    "check_plugin": "plugin_check",
    "plugin_build": "plugin_check",
    "CheckResult": "plugin_check",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hippo.testing' has no attribute {name!r}")
    module = importlib.import_module(f"hippo.testing.{_PUBLIC[name] or name}")
    return module if _PUBLIC[name] is None else getattr(module, name)


def __dir__() -> list[str]:
    return __all__
