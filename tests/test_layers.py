"""The packages import only downward: the core knows nothing of plugins, adapters or front ends.

hippo (core) <- hippo_media (video files -> inputs) <- hippo_plugins, hippo_adapters <-
hippo.testing (the harness: it checks, and plants bugs in, the built-in parts) <- hippo_cli (front
ends, with the demo's pair and the timeline chart) <- hippo_benchmarks (the research: training,
evaluation, `hippo bench`). The product never imports the benchmarks. Checked on the source with
`ast`, lazy imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # import name -> (directory, import names it may use besides itself)
    "hippo": ("hippo", set()),  # without hippo/testing
    "hippo.testing": ("hippo/testing", {"hippo", "hippo_media", "hippo_plugins", "hippo_adapters"}),
    "hippo_media": ("media", {"hippo"}),
    "hippo_plugins": ("plugins", {"hippo", "hippo_media"}),
    "hippo_adapters": ("adapters", {"hippo", "hippo_media"}),
    "hippo_cli": ("cli", {"hippo", "hippo.testing", "hippo_media", "hippo_plugins", "hippo_adapters"}),
    "hippo_benchmarks": (
        "benchmarks",
        {"hippo", "hippo_media", "hippo_plugins", "hippo_adapters", "hippo_cli"},
    ),
}


def _layer(module: str) -> str:
    """The entry of PACKAGES a dotted module name belongs to (or its top-level name)."""
    return (
        "hippo.testing"
        if module == "hippo.testing" or module.startswith("hippo.testing.")
        else module.split(".")[0]
    )


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {_layer(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(_layer(node.module) if node.module != "hippo" else _from_hippo(node))
    return out


def _from_hippo(node: ast.ImportFrom) -> str:  # `from hippo import testing` names the harness
    return "hippo.testing" if any(a.name == "testing" for a in node.names) else "hippo"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_point_down(package):
    folder, allowed = PACKAGES[package]
    ours = set(PACKAGES) | {"benchmarks"}
    wrong = {}
    files = sorted(f for f in (ROOT / folder).rglob("*.py") if package != "hippo" or "testing" not in f.parts)
    assert files, f"no modules found in {folder}/"
    for f in files:
        bad = (_imports(f) & ours) - allowed - {package}
        if bad:
            wrong[str(f.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"{package} imports upward or sideways: {wrong}"


def test_no_sys_path_edits_in_packages():
    for folder, _ in PACKAGES.values():
        for f in (ROOT / folder).rglob("*.py"):
            assert "sys.path.insert" not in f.read_text(), f"{f} edits sys.path"


def test_the_product_never_imports_the_benchmarks():
    """The demo's pair and the timeline chart ship with the front ends (hippo_cli.pair,
    hippo_cli.timeline): no package but the benchmarks themselves may import hippo_benchmarks."""
    allowed = {name for name, (_, uses) in PACKAGES.items() if "hippo_benchmarks" in uses}
    assert not allowed, f"{sorted(allowed)} may import hippo_benchmarks"
