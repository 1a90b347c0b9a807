"""The package's shape (docs/design.md, Layout): no module past 450 lines, no import cycle between modules, the
layers' arrows point one way (down, LAYERS), and nothing below the peer reaches it, even through another module
(the bootstrap runs without the peer). Read from the source, so a new arrow fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

SWARM = Path(__file__).resolve().parent.parent / "swarm"
MAX_LINES = 450
MAX_PEER_MODULES = 12  # swarm/peer/'s top level; what does one thing lives in a package of its own (state/, pipeline/)

# The floors of the house, bottom first: a module imports only from its own package or from a lower floor (so two
# packages of one floor never import each other). docs/design.md draws the same picture.
LAYERS = (
    ("swarm", "swarm.combinations", "swarm.compression", "swarm.events", "swarm.runtime", "swarm.settings_cli",
     "swarm.words"),
    ("swarm.config",),
    ("swarm.dht", "swarm.settings"),
    ("swarm.averaging", "swarm.data", "swarm.monitoring"),
    ("swarm.model",),
    ("swarm.checks", "swarm.demo"),
    ("swarm.reachability",),
    ("swarm.bootstrap", "swarm.doctor"),
    ("swarm.peer",),
    ("swarm.cli", "swarm.simulation"),
    ("swarm.__main__",),
)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SWARM.rglob("*.py")):
        parts = path.relative_to(SWARM.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The swarm modules `path` imports anywhere in its body (function-level imports included)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, name, set(found)) for name, path in found.items()}


def test_no_module_is_longer_than_450_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_no_import_cycle():
    graph = import_graph()
    # Package __init__ files re-export their modules; an arrow into a package is an arrow into what it exports.
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if target.startswith(node + "."):  # a package importing its own modules
                continue
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target] if target in stack else [node, target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_monitoring_the_bootstrap_and_the_data_layer_do_not_import_the_peer():
    graph = import_graph()
    wrong = {name: sorted(t for t in targets if t.startswith("swarm.peer"))
             for name, targets in graph.items()
             if name.startswith(("swarm.monitoring", "swarm.dht.", "swarm.data.")) or name in ("swarm.bootstrap",
                                                                                         "swarm.dht", "swarm.data")}
    assert not {k: v for k, v in wrong.items() if v}, wrong


def unit(module: str) -> str:
    """The entry of LAYERS a module belongs to: its package (swarm.dht.view -> swarm.dht) or itself."""
    units = {name for floor in LAYERS for name in floor}
    while module not in units:
        if "." not in module:
            raise AssertionError(f"{module} is on no floor of LAYERS: add it there")
        module = module.rpartition(".")[0]
    return module


def test_every_import_points_down():
    floor = {name: level for level, names in enumerate(LAYERS) for name in names}
    up = []
    for name, targets in import_graph().items():
        for target in targets:
            a, b = unit(name), unit(target)
            if a != b and floor[b] >= floor[a]:
                up.append(f"{name} -> {target} (floor {floor[a]} -> {floor[b]})")
    assert not up, "imports that do not point down: " + "; ".join(sorted(up))


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_nothing_below_the_peer_reaches_it_even_indirectly():
    """The bootstrap (and doctor, the checks, the model, monitoring, data, dht, averaging) run without the peer: no
    chain of imports, function-level ones included, leads from them to swarm.peer."""
    graph = import_graph()
    below = [name for name in graph if unit(name) in ("swarm.bootstrap", "swarm.doctor", "swarm.checks", "swarm.model",
                                                      "swarm.monitoring", "swarm.data", "swarm.dht", "swarm.averaging")]
    reached = {name: sorted(t for t in reachable(graph, name) if t.startswith("swarm.peer")) for name in below}
    assert "swarm.bootstrap" in below and not {k: v for k, v in reached.items() if v}, reached


def test_the_peer_package_keeps_a_short_top_level():
    top = sorted(path.stem for path in (SWARM / "peer").glob("*.py") if path.stem != "__init__")
    assert len(top) <= MAX_PEER_MODULES, f"swarm/peer/ has {len(top)} modules at its top level: {top}"


def test_the_bootstrap_and_the_cli_load_without_transformers():
    """transformers takes seconds to import: a bootstrap (and `swarm-peer --help`, `status`) must not wait for it,
    so the model layer is imported where a model is built, not at the top of what the bootstrap imports."""
    import subprocess
    import sys

    code = "import sys, swarm.bootstrap, swarm.cli; print(sorted(m for m in ('transformers',) if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
