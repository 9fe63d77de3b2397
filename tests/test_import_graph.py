"""pdserve's modules import each other without a cycle, and no import runs up a floor: every import counts,
at the top of a module, inside a function or under TYPE_CHECKING (a cycle there still ties the two modules'
designs together)."""

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


# The floors, lowest first: a module may import its own floor and those below, never one above. A module's
# floor is that of the longest prefix listed. The kernels are the ground floor of the models, the engine and
# the tensor-parallel all-reduce; kv_transfer shares parallel's floor (the all-reduce's segment comes from its
# shared-memory agent) and stays out of the models (test_the_kv_exchange_knows_no_model).
FLOORS = [
    ("pdserve", "pdserve.host", "pdserve.host_malloc", "pdserve.cluster_auth", "pdserve.tls", "pdserve.json_writer",
     "pdserve.tokenizer",
     "pdserve.weights", "pdserve.env"),
    ("pdserve.kernels",),
    ("pdserve.parallel", "pdserve.kv_transfer"),
    ("pdserve.models",),
    ("pdserve.config", "pdserve.engine"),
    ("pdserve.server",),
    ("pdserve.orchestrator",),
    ("pdserve.bench", "pdserve.plan", "pdserve.launch", "pdserve.testing", "pdserve.cli", "pdserve.__main__"),
]


def _floor(module: str) -> int:
    best, floor = "", None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, floor = p, i
    return floor


def test_no_import_runs_up_a_floor():
    mods = _modules()
    unplaced = sorted(m for m in mods if _floor(m) == 0 and m != "pdserve" and not any(
        m == p or m.startswith(p + ".") for p in FLOORS[0][1:]))
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"
    upward = sorted(f"{m} -> {t}" for m, f in mods.items() for t in _imports(m, f, mods) if _floor(t) > _floor(m))
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_the_kv_exchange_knows_no_model():
    """kv_transfer/ moves opaque pools between roles: it imports nothing of models/ (and models/ nothing of it)."""
    mods = _modules()
    crossing = sorted(f"{m} -> {t}" for m, f in mods.items() for t in _imports(m, f, mods)
                      for a, b in (("pdserve.kv_transfer", "pdserve.models"), ("pdserve.models", "pdserve.kv_transfer"))
                      if m.startswith(a) and t.startswith(b))
    assert not crossing, crossing
