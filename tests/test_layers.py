"""The packages import only downward: the core knows nothing of plugins, adapters or front ends.

hippo (core) <- hippo.media (video files -> inputs) <- hippo.plugins, hippo.adapters <- hippo.cli
(front ends, with the demo's pair and the timeline chart) <- hippo.benchmarks (the research:
training, evaluation, `hippo bench`); hippo.eval (lmms-eval's `hippo` model and `hippo eval`) sits
beside the benchmarks, on the front ends. hippo.testing (the harness: it checks, and plants bugs in,
pipeline parts) builds on the core alone: it reaches the built-in parts through the registry, as a
third-party plugin would. The product never imports the benchmarks. Checked on the source with
`ast`, lazy imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # import name -> (directory, import names it may use besides itself)
    "hippo": ("hippo", set()),  # without hippo/testing
    "hippo.testing": ("hippo/testing", {"hippo"}),  # the core's interfaces; plugins through the registry
    "hippo.media": ("media", {"hippo"}),
    "hippo.plugins": ("plugins", {"hippo", "hippo.media"}),
    "hippo.adapters": ("adapters", {"hippo", "hippo.media"}),
    "hippo.cli": ("cli", {"hippo", "hippo.testing", "hippo.media", "hippo.plugins", "hippo.adapters"}),
    "hippo.benchmarks": (
        "benchmarks",
        {"hippo", "hippo.media", "hippo.plugins", "hippo.adapters", "hippo.cli"},
    ),
    "hippo.eval": ("eval", {"hippo", "hippo.media", "hippo.plugins", "hippo.adapters", "hippo.cli"}),
}


def _layer(module: str) -> str:
    """The entry of PACKAGES a dotted module name belongs to (or its top-level name)."""
    parts = module.split(".")
    sub = ".".join(parts[:2])
    return sub if sub in PACKAGES else parts[0]


def _module_name(path: Path) -> tuple[str, bool]:
    """(the dotted name `path` is imported as, whether it is a package's __init__): hippo/testing/x.py
    is hippo.testing.x, plugins/a.py is hippo.plugins.a."""
    rel = path.resolve().relative_to(ROOT).with_suffix("").parts
    for name, (folder, _) in sorted(PACKAGES.items(), key=lambda kv: -len(kv[1][0])):
        top = tuple(folder.split("/"))
        if rel[: len(top)] == top:
            parts = [*name.split("."), *rel[len(top) :]]
            init = parts[-1] == "__init__"
            return ".".join(parts[:-1] if init else parts), init
    raise AssertionError(f"{path} is in no package of PACKAGES")


def _imports_of(source: str, module: str, init: bool = False) -> set[str]:
    """The PACKAGES entries (or top-level names) that `module`'s source imports: `import a.b`,
    `from a.b import c`, relative imports resolved against `module`, and every name of
    `from hippo import a, b` (a subpackage of PACKAGES names it, any other name hippo itself)."""
    here = module.split(".") if init else module.split(".")[:-1]  # the package relative imports start in
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {_layer(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                full = ".".join([*base, *([node.module] if node.module else [])])
            else:
                full = node.module or ""
            for a in node.names:  # `from p import a`: a may be a submodule of p
                sub = f"{full}.{a.name}"
                out.add(_layer(sub) if _layer(sub) in PACKAGES else _layer(full))
    return out


def _imports(path: Path) -> set[str]:
    module, init = _module_name(path)
    return _imports_of(path.read_text(), module, init)


def test_the_import_scan_sees_relative_imports_and_every_name():
    """The scan itself: relative imports resolve against the module's package, and each name of
    `from hippo import a, b` counts."""
    assert _imports_of("from hippo import errors, testing, plugins", "hippo.cli.x") == {
        "hippo",
        "hippo.testing",
        "hippo.plugins",
    }
    assert _imports_of("from ..benchmarks import runner", "hippo.cli.x") == {"hippo.benchmarks"}
    assert _imports_of("from .. import benchmarks", "hippo.cli.x") == {"hippo.benchmarks"}
    assert _imports_of("from . import tree", "hippo.plugins.a") == {"hippo.plugins"}
    assert _imports_of("from .tree import Tree", "hippo.plugins", init=True) == {"hippo.plugins"}
    assert _imports_of("import hippo.testing.sampling as s", "hippo.x") == {"hippo.testing"}
    assert _module_name(ROOT / "hippo" / "testing" / "matrix.py") == ("hippo.testing.matrix", False)
    assert _module_name(ROOT / "plugins" / "__init__.py") == ("hippo.plugins", True)


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
    """The demo's pair and the timeline chart ship with the front ends (hippo.cli.pair,
    hippo.cli.timeline): no file of another package imports hippo.benchmarks (scanned, not read off
    PACKAGES)."""
    wrong = {}
    for package, (folder, _) in PACKAGES.items():
        if package == "hippo.benchmarks":
            continue
        for f in (ROOT / folder).rglob("*.py"):
            if package == "hippo" and f.is_relative_to(ROOT / "hippo" / "testing"):
                continue  # scanned as hippo.testing
            if {"hippo.benchmarks", "benchmarks"} & _imports(f):
                wrong[str(f.relative_to(ROOT))] = package
    assert not wrong, f"these import hippo.benchmarks: {wrong}"


# ---- inside the core: the module order stated in the README's layout section ----------------------

ORDER_MARK = "inside hippo/:"


def core_order() -> list[set[str]]:
    """The README's line `- inside hippo/: a > b, c > ...`: groups of modules, each importing only
    from the groups to its right."""
    line = next(li for li in (ROOT / "README.md").read_text().splitlines() if ORDER_MARK in li)
    groups = line.split(ORDER_MARK, 1)[1].strip().strip("`").split(" > ")
    return [{m.strip() for m in g.split(",")} for g in groups]


def _core_imports(path: Path) -> set[str]:
    """The hippo/*.py modules `path` imports, type-checking-only and function-level imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "hippo" and len(parts) == 2 and f"hippo.{parts[1]}" not in PACKAGES:
                out.add(parts[1])
            elif node.module == "hippo":
                out |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("hippo.")}
    return out - {"testing"}


def test_the_core_imports_follow_the_readme_order():
    groups = core_order()
    rank = {m: i for i, g in enumerate(groups) for m in g}
    modules = {f.stem for f in (ROOT / "hippo").glob("*.py")} - {"__init__"}
    assert modules == set(rank), (
        f"the README's order misses {modules - set(rank)} or names {set(rank) - modules}"
    )
    wrong = []
    for name in sorted(modules):
        for dep in sorted(_core_imports(ROOT / "hippo" / f"{name}.py") & modules - {name}):
            if rank[dep] <= rank[name]:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, f"core imports that do not point right in the README's order: {wrong}"


def test_the_package_face_only_re_exports():
    """`hippo/__init__.py` stands above the order: it imports the public names and defines nothing
    but `__version__`, so it adds no layer of its own."""
    tree = ast.parse((ROOT / "hippo" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            continue
        assert isinstance(node, ast.ImportFrom), f"hippo/__init__.py line {node.lineno} is not a re-export"
