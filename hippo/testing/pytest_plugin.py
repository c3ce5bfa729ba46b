"""The pytest plugin of hippo.testing (entry point group `pytest11`, loaded by every pytest run once
hippo is installed): a `--hippo-examples N` option and fixtures that give a plugin's own test suite
the tiny pairs and the checks.

It imports nothing heavy at load time and needs hypothesis only when a fixture is used, so it
neither slows nor breaks a suite that does not use it.

    def test_my_scheduler(hippo_lossless):
        hippo_lossless.greedy(lambda case: case.builder(scheduler="my_scheduler"))
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hippo", "hippo.testing (lossless harness)")
    group.addoption(
        "--hippo-examples",
        type=int,
        default=None,
        metavar="N",
        help="hypothesis examples per hippo.testing check (default: the hypothesis profile's max_examples)",
    )


def pytest_configure(config: pytest.Config) -> None:
    n = config.getoption("hippo_examples", None)
    if n is not None:
        if n < 1:
            raise pytest.UsageError(f"--hippo-examples must be >= 1, got {n}")
        from hippo.testing.options import set_default_examples

        set_default_examples(n)


class Lossless:
    """The checks, bound to the session's `--hippo-examples` (each call may still pass examples=)."""

    def __init__(self, examples: int | None):
        self.examples = examples

    def greedy(self, build: Any, **kwargs: Any) -> Any:
        from hippo.testing.greedy import assert_greedy_lossless

        kwargs.setdefault("examples", self.examples)
        return assert_greedy_lossless(build, **kwargs)

    def sampling(self, build: Any, **kwargs: Any) -> Any:
        from hippo.testing.sampling import assert_sampling_exact

        return assert_sampling_exact(build, **kwargs)


@pytest.fixture(scope="session")
def hippo_examples(pytestconfig: pytest.Config) -> int | None:
    """The `--hippo-examples` value (None: the hypothesis profile decides)."""
    return pytestconfig.getoption("hippo_examples", None)


@pytest.fixture(scope="session")
def hippo_lossless(hippo_examples: int | None) -> Lossless:
    """`hippo_lossless.greedy(build, ...)` and `hippo_lossless.sampling(build, ...)`."""
    from hippo.testing._deps import require_hypothesis

    require_hypothesis()
    return Lossless(hippo_examples)


@pytest.fixture(scope="session")
def hippo_tiny():
    """`hippo_tiny(adapter, role='target', seed=0)`: a float64 tiny model, built once per process."""
    from hippo.testing.models import tiny

    return tiny


@pytest.fixture(scope="session")
def hippo_adapters() -> list[str]:
    """Registered adapters that provide a tiny model (a third party's included)."""
    from hippo.testing.models import tiny_adapters

    return tiny_adapters()


@pytest.fixture(scope="session")
def hippo_pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """(target, draft): the tiny float64 pair of the first adapter with a tiny model (qwen2_5_vl if
    installed); use `hippo_tiny` for another adapter."""
    from hippo.testing.models import tiny
    from hippo.testing.sampling import default_adapter

    adapter = default_adapter()
    return tiny(adapter, "target"), tiny(adapter, "draft", 1)


@pytest.fixture
def hippo_corrupting_drafter():
    """Registers the corrupting drafter for the test; yields its registry name."""
    from hippo.testing.drafters import corrupting_plugin

    with corrupting_plugin() as name:
        yield name
