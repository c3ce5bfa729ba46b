"""tests/fixtures' example distributions installed for real, and the environment of the suite's
Python subprocesses (used by tests/conftest.py's `installed_fixtures`, tests/test_plugins.py and
tests/test_testing.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
#: tests/fixtures' distributions: the lossy one (hippo_lossy_example) and the third-party one
DISTRIBUTIONS = {"lossy": "hippo_lossy_example", "thirdparty": "hippo_thirdparty_example"}
#: The tests that use the `installed_fixtures` fixture run on one xdist worker, which installs once.
GROUP = pytest.mark.xdist_group("installed")


def install(root: Path) -> Path:
    """Both distributions installed with one `pip install --target <root>/site`; returns the site.
    Built from copies of the sources, so setuptools' build/ and *.egg-info never land in the
    repository."""
    site, sources = root / "site", []
    for name in DISTRIBUTIONS:
        copy = root / name
        shutil.copytree(
            FIXTURES / name, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
        )
        sources.append(str(copy))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd += ["--disable-pip-version-check", "--quiet", "--target", str(site), *sources]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"installing the fixture plugins failed:\n{proc.stdout}\n{proc.stderr}"
    for dist in DISTRIBUTIONS.values():
        assert list(site.glob(f"{dist}-*.dist-info")), f"pip installed no {dist} dist-info"
    return site


def subprocess_env(site: Path | None = None, **overrides: str) -> dict[str, str]:
    """The environment of a test's Python subprocess: this one's, with `site` first on PYTHONPATH,
    one torch thread (OMP_NUM_THREADS=1, as tests/conftest.py sets in the workers: with the default
    two threads while the other xdist worker ran, a subprocess decoded the tiny models 3-15x slower)
    and `overrides`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env.update(overrides)
    return env
