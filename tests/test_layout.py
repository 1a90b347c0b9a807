"""The package's shape (DESIGN.md, issue 23): no module past 450 lines, no import cycle between modules, and the
layers' arrows point one way (monitoring, the bootstrap and the data layer never import the peer). Read from the
source, so a new arrow fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

SWARM = Path(__file__).resolve().parent.parent / "swarm"
MAX_LINES = 450


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
