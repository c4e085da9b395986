"""The package's shape stays as docs/architecture.md draws it: packages in layers, each importing
only from its own package or from a lower layer (function-level imports included: a lazy import
that dodges the order still breaks it), no import cycle, no module taking another module's
underscore names, the engine a thin face, and no module past ~600 lines. Read from the source with
`ast`; nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tiered"
MAX_LINES = 620  # "~600": a module past this is split before it grows further
ENGINE_MAX_LINES = 300
# The packages and top-level modules, bottom layer first. A module imports from its own package or
# from a lower layer; packages that share a layer do not import each other. Data flows one way:
# format -> codecs -> tiers -> stage -> gpu -> save / restore / migrate -> distributed -> engine.
LAYERS = [
    {"tiered.errors", "tiered.units", "tiered.version", "tiered.threads", "tiered.policy", "tiered.testing"},
    {"tiered.format", "tiered.config"},
    {"tiered.codecs"},
    {"tiered.tiers", "tiered.observe"},
    {"tiered.stage"},
    {"tiered.gpu"},
    {"tiered.save", "tiered.restore", "tiered.migrate"},
    {"tiered.distributed"},
    {"tiered.engine"},
    {"tiered.dcp", "tiered.integrations", "tiered.cli"},
    {"tiered"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:  # `from pkg import module`
                    found.append((f"{source}.{a.name}", None, node.lineno))
                else:
                    found.append((source, a.name, node.lineno))
    return [f for f in found if f[0] == "tiered" or f[0].startswith("tiered.")]


def graph() -> dict[str, set[str]]:
    """Module -> the tiered modules it imports. A package's own `__init__` importing its
    submodules is not an edge from them (Python runs it first, whichever submodule is named)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for source, _, _ in _imports(name, path):
            if source in MODULES and source != name and not name.startswith(source + "."):
                edges[name].add(source)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_cycle_finder_finds_a_cycle():
    # The check below is only as good as this: a planted cycle through a lazy import is found.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_module_takes_another_modules_underscore_names():
    bad = []
    for name, path in MODULES.items():
        for source, taken, line in _imports(name, path):
            owner = source.rpartition(".")[0]
            # A private module (codecs/_nvcomp.py) is for its own package only.
            if source in MODULES and _private(source.rpartition(".")[2]) and not name.startswith(owner + "."):
                bad.append(f"{path.name}:{line} imports the private module {source}")
            if taken is not None and _private(taken) and source != name:
                bad.append(f"{path.name}:{line} takes {taken} from {source}")
    assert not bad, "\n".join(bad)


def unit(module: str) -> str:
    """The package (or top-level module) a module belongs to: tiered.gpu.device -> tiered.gpu."""
    return ".".join(module.split(".")[:2])


def layer_of(module: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit(module) in units:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: place its package there")


def order_violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, targets in edges.items():
        for target in targets:
            if unit(target) != unit(name) and layer_of(target) >= layer_of(name):
                bad.append(f"{name} imports {target}, which is not below it")
    return sorted(bad)


def test_order_checker_finds_an_upward_import():
    # As good as this: an import from a higher layer, or between two packages of one layer, is found.
    assert order_violations({"tiered.format.manifest": {"tiered.gpu.device"}}) == [
        "tiered.format.manifest imports tiered.gpu.device, which is not below it"]
    assert order_violations({"tiered.save.pipeline": {"tiered.migrate.migrator"}}) != []
    assert order_violations({"tiered.gpu.device": {"tiered.gpu.layout", "tiered.stage.plan"}}) == []


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_packages_import_only_from_below():
    assert order_violations(graph()) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    limit = ENGINE_MAX_LINES if name == "tiered.engine" else MAX_LINES
    assert lines <= limit, f"{MODULES[name]} has {lines} lines (at most {limit}): split it"


def test_one_catalog_for_the_library_and_the_command_line():
    # The CLI and the migrator never list tiers themselves: they go through tiered.tiers.catalog.
    edges = graph()
    assert "tiered.tiers.catalog" in edges["tiered.cli.commands"] and "tiered.tiers.catalog" in edges["tiered.engine"]
    for name in ("tiered.cli.commands", "tiered.migrate.migrator", "tiered.engine"):
        source = MODULES[name].read_text()
        assert "make_tier(" not in source, f"{name} creates tiers itself instead of asking the catalog"
