"""pdserve's modules import each other without a cycle: every import counts, at the top of a module,
inside a function or under TYPE_CHECKING (a cycle there still ties the two modules' designs together)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _modules() -> dict[str, Path]:
    mods = {}
    for f in (ROOT / "pdserve").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The pdserve modules `module` imports (a name imported from a package counts as its submodule
    when it is one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != module:
                out.add(target)
    return out


def test_the_import_graph_has_no_cycle():
    mods = _modules()
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert sum(map(len, graph.values())) > 200  # the walk found the imports
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None
