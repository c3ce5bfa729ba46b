"""Shared test configuration.

Hypothesis profiles, chosen with the environment variable HYPOTHESIS_PROFILE:
- `dev` (default): a handful of examples per test, for quick local runs;
- `ci`: 15 examples a test (weighted per test: `hippo.testing.strategies.examples`), several
  hundred in tests/lossless in all. Not derandomized: each run explores new examples; a failure
  prints its `@reproduce_failure` blob and the harness's one-line reproduction
  (hippo.testing.report). The cases that failed before run every time as
  fixed examples (`hippo.testing.greedy.regression_cases`, and `@example`s on the tests).
- `repeat`: the `ci` profile derandomized, to re-run exactly the examples of a previous run.

    HYPOTHESIS_PROFILE=ci python -m pytest tests/lossless tests/test_testing.py -q

pytest-xdist runs the suite on every core (`-n auto --dist loadgroup` in pyproject.toml's addopts;
`-n 0` for one process); tests that start draft processes or time overlapped work carry
`pytest.mark.xdist_group("processes")` and run one after the other on one worker.

The lossless harness is hippo.testing (installed with hippo); its pytest plugin adds
`--hippo-examples N`, which the checks use when given. Tests marked `gpu` are skipped when CUDA is not available.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

from hippo.testing.drafters import corrupting_plugin
from hippo.testing.models import tiny as tiny_model

PROFILE_ENV = "HYPOTHESIS_PROFILE"

# tests/fixtures holds example plugin packages (and their own test suites, run in subprocesses by
# tests/test_plugins.py and tests/test_testing.py with the packages installed): not collected here.
collect_ignore_glob = ["fixtures/*"]

settings.register_profile(
    "dev",
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("repeat", settings.get_profile("ci"), derandomize=True)
settings.load_profile(os.environ.get(PROFILE_ENV, "dev"))

# The tiny models are far too small for intra-op threads to pay off; on a shared 2-core machine
# thread contention made them about 10x slower. One thread keeps the suite fast and steady.
torch.set_num_threads(1)

# scheduler="auto" caches its measured costs under $XDG_CACHE_HOME/hippo: keep the suite's apart
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hippo-tests-cache-")


def pytest_report_header(config: pytest.Config) -> str:
    name = os.environ.get(PROFILE_ENV, "dev")
    return f"hypothesis profile: {name} (max_examples={settings().max_examples}; set {PROFILE_ENV})"


def _longest_first(item: pytest.Item) -> int:
    """xdist hands the two workers the tests in collection order, so a long test collected last
    leaves one worker idle while the other finishes it: the xdist groups (one worker runs each group
    whole, minutes) go first, then the `slow` tests, then tests/lossless (the harness's drawn cases and
    the ~2,000-run law checks), then the rest, short unit and CLI tests that even out the end."""
    if item.get_closest_marker("xdist_group"):
        return 0
    if item.get_closest_marker("slow"):
        return 1
    return 2 if "lossless" in item.path.parts else 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_longest_first)  # stable: a module's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny():
    """`tiny(adapter, role='target', seed=0)`: a float64 tiny model, built once per session."""
    return tiny_model


@pytest.fixture(scope="session")
def corrupting_drafter():
    """Registers the test plugin's `CorruptingDrafter`; yields its registry name."""
    with corrupting_plugin() as name:
        yield name


@pytest.fixture(scope="session")
def installed_fixtures(tmp_path_factory: pytest.TempPathFactory):
    """tests/fixtures' lossy and third-party distributions installed for real with one `pip install
    --target <dir>` per session (tests/installed.py); yields <dir>. Tests using it carry
    `installed.GROUP`, so one xdist worker installs them once."""
    from installed import install

    return install(tmp_path_factory.mktemp("installed"))
