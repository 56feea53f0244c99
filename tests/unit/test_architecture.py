"""Architecture rules anyone can check without a GPU, a daemon or a network.

- **No import cycles**, between modules of ``sclsd/`` and ``worker/`` and
  between their packages. Every import counts: module level, inside a
  function, under ``if TYPE_CHECKING:``.
- **Size limits**: no class over 300 lines, no module over 600.
- **Light imports**: the client library, the wire protocol and the policy
  core pull in only what they need (the core is pure policy: no I/O stack,
  no ML stack, no clock); the daemon's serving core does no I/O either.

Each rule's machinery is also run on a small synthetic case here, so a rule
that silently stopped detecting anything would fail too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_PACKAGES = ("sclsd", "worker")
MAX_CLASS_LINES = 300
MAX_MODULE_LINES = 600

# --------------------------------------------------------------------------- the import graph


@dataclass
class ImportGraph:
    """Modules of a source tree and which of them each one imports (with the importing line)."""

    files: dict[str, Path]
    packages: set[str]
    """Names whose file is an ``__init__.py``."""
    edges: dict[str, dict[str, str]] = field(default_factory=dict)
    """``edges[a][b]``: where ``a`` imports ``b``, as ``path:line``."""


def find_modules(root: Path, tops: Iterable[str]) -> tuple[dict[str, Path], set[str]]:
    """Dotted name -> file for every ``.py`` under ``root/<top>``, and the package names.

    Where a package and a module share a name (``x/__init__.py`` beside
    ``x.py``), Python imports the package, so the package's file wins.
    """
    files: dict[str, Path] = {}
    packages: set[str] = set()
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            name = ".".join(parts)
            if name in packages:
                continue
            files[name] = path
            if is_pkg:
                packages.add(name)
    return files, packages


def _resolve_from(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    """The absolute module a ``from ... import`` names (before looking at the imported names)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(
    tree: ast.AST, module: str, is_pkg: bool, known: Mapping[str, Path] | set[str]
) -> Iterable[tuple[str, int]]:
    """``(module, line)`` for every import of a known module anywhere in ``tree``.

    ``from pkg import name`` means the submodule ``pkg.name`` when there is
    one, else ``pkg`` itself; ``import a.b.c`` means the longest known prefix.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                for k in range(len(parts), 0, -1):
                    if ".".join(parts[:k]) in known:
                        yield ".".join(parts[:k]), node.lineno
                        break
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, module, is_pkg)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                if sub in known:
                    yield sub, node.lineno
                elif base in known:
                    yield base, node.lineno


def build_graph(root: Path, tops: Iterable[str] = TOP_PACKAGES) -> ImportGraph:
    """Parse every module under ``root/<top>`` and record its imports of the others."""
    files, packages = find_modules(root, tops)
    graph = ImportGraph(files, packages)
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        out = graph.edges.setdefault(name, {})
        for dep, line in imported_modules(tree, name, name in packages, files):
            if dep != name:
                out.setdefault(dep, f"{path.relative_to(root)}:{line}")
    return graph


def package_of(module: str, packages: set[str], roots: Iterable[str]) -> str | None:
    """The unit ``module`` collapses to in the package-level graph; None for a root package.

    A package stands for itself and its plain modules (``sclsd.sim.engine`` ->
    ``sclsd.sim``). The root ``sclsd`` package is a namespace of layers, not
    one: its own ``__init__`` is left out and each of its plain modules
    (``sclsd.protocol``, ``sclsd.client``) is a unit of its own.
    """
    if module in roots:
        return None
    if module in packages:
        return module
    parent = module.rpartition(".")[0]
    return module if parent in roots else parent


def package_graph(
    graph: ImportGraph, roots: Iterable[str] = ("sclsd",)
) -> dict[str, dict[str, str]]:
    """The import graph with modules collapsed to packages; edges inside one package dropped."""
    roots = set(roots)
    out: dict[str, dict[str, str]] = {}
    for a, deps in graph.edges.items():
        pa = package_of(a, graph.packages, roots)
        if pa is None:
            continue
        node = out.setdefault(pa, {})
        for b, where in deps.items():
            pb = package_of(b, graph.packages, roots)
            if pb is not None and pb != pa:
                node.setdefault(pb, f"{where} ({a} -> {b})")
    return out


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def one_cycle(graph: Mapping[str, Iterable[str]], comp: list[str]) -> list[str]:
    """A concrete cycle through the component's first node (breadth-first, so a shortest one)."""
    members = set(comp)
    start = comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")


def describe_cycles(edges: Mapping[str, Mapping[str, str]]) -> list[str]:
    """One message per cycle: its members, then each import of one concrete cycle."""
    out = []
    for comp in strongly_connected(edges):
        cycle = one_cycle(edges, comp)
        steps = [f"    {a} -> {b}  at {edges[a][b]}" for a, b in pairwise(cycle)]
        out.append(f"cycle among {', '.join(comp)}:\n" + "\n".join(steps))
    return out


def test_no_import_cycle_between_modules() -> None:
    problems = describe_cycles(build_graph(ROOT).edges)
    assert not problems, "import cycles:\n" + "\n".join(problems)


def test_no_import_cycle_between_packages() -> None:
    problems = describe_cycles(package_graph(build_graph(ROOT)))
    assert not problems, "package import cycles:\n" + "\n".join(problems)


def test_simulator_never_imports_the_benchmarks() -> None:
    """sim and bench share eval; only bench may use sim (figures run simulations)."""
    pkgs = package_graph(build_graph(ROOT))
    assert "sclsd.bench" not in pkgs.get("sclsd.sim", {})
    assert "sclsd.bench" not in pkgs.get("sclsd.eval", {})
    assert "sclsd.sim" not in pkgs.get("sclsd.eval", {})


# --------------------------------------------------------------------------- the checks can fail


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_tarjan_finds_every_cycle_and_nothing_else() -> None:
    g = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["a"], "g": ["g"]}
    assert strongly_connected(g) == [["a", "b", "c"], ["d", "e"]]
    assert one_cycle(g, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": []}) == []


def test_graph_counts_relative_function_local_and_type_only_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/core/__init__.py": "",
            # a type-only edge ...
            "pkg/core/a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from .b import B\n"
            ),
            # ... closed by a function-local `from pkg import module`
            "pkg/core/b.py": "def f():\n    from pkg.core import a\n    return a\n",
            "pkg/core/c.py": "import pkg.core.b\nfrom .. import core\nimport numpy\n",
        },
    )
    g = build_graph(root, ["pkg"])
    assert g.edges["pkg.core.a"] == {"pkg.core.b": "pkg/core/a.py:3"}
    assert set(g.edges["pkg.core.b"]) == {"pkg.core.a"}
    # `from .. import core` is the package's __init__; numpy is not ours.
    assert set(g.edges["pkg.core.c"]) == {"pkg.core.b", "pkg.core"}
    (msg,) = describe_cycles(g.edges)
    assert "pkg.core.a -> pkg.core.b  at pkg/core/a.py:3" in msg


def test_package_cycle_without_a_module_cycle_is_found(tmp_path: Path) -> None:
    """sim.x -> bench.y and bench.z -> sim.w: no module cycle, but sim <-> bench."""
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/protocol.py": "",
            "pkg/client.py": "from . import protocol\n",
            "pkg/sim/__init__.py": "",
            "pkg/sim/x.py": "from ..bench.y import Y\nfrom .. import client\n",
            "pkg/sim/w.py": "import pkg\n",
            "pkg/bench/__init__.py": "",
            "pkg/bench/y.py": "",
            "pkg/bench/z.py": "from pkg.sim import w\nfrom pkg.protocol import P\n",
        },
    )
    g = build_graph(root, ["pkg"])
    assert describe_cycles(g.edges) == []
    pg = package_graph(g, roots=["pkg"])
    # The root package's plain modules are units of their own; its __init__ is no unit.
    assert set(pg) == {"pkg.protocol", "pkg.client", "pkg.sim", "pkg.bench"}
    assert set(pg["pkg.sim"]) == {"pkg.bench", "pkg.client"}
    (msg,) = describe_cycles(pg)
    assert msg.startswith("cycle among pkg.bench, pkg.sim")


def test_package_beats_a_module_of_the_same_name(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/d.py": "x", "pkg/d/__init__.py": ""})
    files, packages = find_modules(root, ["pkg"])
    assert files["pkg.d"] == root / "pkg/d/__init__.py"
    assert packages == {"pkg", "pkg.d"}


# --------------------------------------------------------------------------- sizes


def oversized(path: Path, root: Path) -> list[str]:
    """Why ``path`` breaks the size limits (a module over 600 lines, a class over 300)."""
    text = path.read_text()
    rel = path.relative_to(root)
    out = []
    n = len(text.splitlines())
    if n > MAX_MODULE_LINES:
        out.append(f"{rel}: module of {n} lines (max {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > MAX_CLASS_LINES:
                out.append(
                    f"{rel}:{node.lineno}: class {node.name} of {size} lines (max {MAX_CLASS_LINES})"
                )
    return out


def test_no_oversized_module_or_class() -> None:
    files, _ = find_modules(ROOT, TOP_PACKAGES)
    problems = [msg for path in files.values() for msg in oversized(path, ROOT)]
    assert not problems, "\n".join(problems)


def test_size_check_catches_long_modules_and_classes(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    big = tmp_path / "big.py"
    big.write_text(f"class Big:\n{body}\n" + "pass\n" * MAX_MODULE_LINES)
    msgs = oversized(big, tmp_path)
    assert any("module of" in m for m in msgs)
    assert any("class Big of 301 lines" in m for m in msgs)
    small = tmp_path / "small.py"
    small.write_text("class Small:\n" + "\n".join(f"    x{i} = {i}" for i in range(299)) + "\n")
    assert oversized(small, tmp_path) == []


# --------------------------------------------------------------------------- light imports


def loaded_after(statements: str, candidates: Iterable[str]) -> list[str]:
    """Which of ``candidates`` are in ``sys.modules`` after running ``statements`` afresh."""
    code = (
        "import json, sys\n"
        f"{statements}\n"
        f"print(json.dumps([m for m in {list(candidates)!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


CORE_DIR = ROOT / "sclsd" / "core"
#: Never behind ``import sclsd.core``: the policy is pure, time is an argument.
CORE_FORBIDDEN = ("zmq", "torch", "asyncio", "uvloop", "transformers")
#: The client is a thin library: no ML or numeric stack.
CLIENT_FORBIDDEN = ("torch", "transformers", "numpy", "scipy")
#: The wire protocol is imported by every process: msgspec and nothing heavy.
PROTOCOL_FORBIDDEN = ("torch", "transformers", "numpy", "scipy", "zmq")


def core_modules() -> list[str]:
    return sorted(f"sclsd.core.{p.stem}" for p in CORE_DIR.glob("*.py") if p.stem != "__init__")


def test_core_has_the_expected_modules() -> None:
    mods = set(core_modules())
    for m in (
        "interfaces", "request", "batch", "estimator", "memory", "batcher", "offloader",
        "policy", "profiles", "scheduler_api", "mechanism", "scheduler", "grants",
        "grant_scheduler",
    ):
        assert f"sclsd.core.{m}" in mods


def test_importing_core_pulls_in_no_io_or_ml_stack() -> None:
    stmts = (
        "import importlib\n"
        f"for m in {['sclsd.core', *core_modules()]!r}: importlib.import_module(m)\n"
        "from sclsd.core.profiles import load_profile, builtin_profiles\n"
        "for n in builtin_profiles(): load_profile(n).cost().t_serve(4, 100, 128)"
    )
    assert loaded_after(stmts, CORE_FORBIDDEN) == []


SERVING_DIR = ROOT / "sclsd" / "daemon" / "serving"
#: The daemon's serving core is I/O-free: no event loop, sockets, transport or clock; the
#: shell around it (sclsd.daemon.server, .shell) does all of that.
SERVING_FORBIDDEN = ("asyncio", "socket", "selectors", "zmq", "uvloop", "torch", "transformers",
                     "prometheus_client")


def serving_modules() -> list[str]:
    return sorted(f"sclsd.daemon.serving.{p.stem}" for p in SERVING_DIR.glob("*.py")
                  if p.stem != "__init__")


def test_serving_core_has_its_parts() -> None:
    mods = set(serving_modules())
    for m in ("core", "effects", "table", "output", "events", "replies", "membership", "dispatch",
              "streaming", "results"):
        assert f"sclsd.daemon.serving.{m}" in mods


def test_importing_the_serving_core_pulls_in_no_io_stack() -> None:
    stmts = (
        "import importlib\n"
        f"for m in {['sclsd.daemon.serving', *serving_modules()]!r}: importlib.import_module(m)"
    )
    assert loaded_after(stmts, SERVING_FORBIDDEN) == []


def _absolute_imports(tree: ast.AST) -> list[str]:
    """Every module a source imports by absolute name, at any depth (lazy imports too)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(SERVING_DIR.glob("*.py")), ids=lambda p: p.name)
def test_serving_core_sources_import_no_io_or_clock(path: Path) -> None:
    """Time and text come in as arguments; effects go out as data. Within the daemon the
    core uses only itself (the shell depends on it, never the other way)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 2:  # from ..x: the daemon's
            raise AssertionError(f"{path.name} imports sclsd.daemon.{node.module}")
    for name in _absolute_imports(tree):
        assert name.split(".")[0] not in ("time", "datetime", *SERVING_FORBIDDEN), f"{path.name} imports {name}"


def test_importing_the_client_pulls_in_no_ml_stack() -> None:
    assert loaded_after("import sclsd.client", CLIENT_FORBIDDEN) == []


def test_importing_the_protocol_stays_light() -> None:
    assert loaded_after("import sclsd.protocol", PROTOCOL_FORBIDDEN) == []


def test_light_import_check_sees_what_a_module_loads() -> None:
    """The batcher needs numpy: the check must see it (else it would pass vacuously)."""
    assert loaded_after("import sclsd.core.batcher", ["numpy", "torch"]) == ["numpy"]


@pytest.mark.parametrize("path", sorted(CORE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_core_sources_import_no_clock_io_or_ml(path: Path) -> None:
    """Time is an argument: no core module imports time or datetime, even lazily."""
    for name in _absolute_imports(ast.parse(path.read_text())):
        assert name.split(".")[0] not in ("time", "datetime", *CORE_FORBIDDEN), f"{path.name} imports {name}"
