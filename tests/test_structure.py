"""The tree's shape: no import cycles between modules or between layers, heavy imports lazy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "service"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every service module -> the service modules it imports anywhere (top level, inside
    functions, under TYPE_CHECKING: a cycle through any of them is still a cycle to read)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name.startswith("service") and name != mod and name != "service":
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def layer(mod: str) -> str:
    """service.ranks.runners.full -> service.ranks; top-level modules are layers of their own."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules():
    cycle = find_cycle(imports())
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycle_between_layers():
    layers: dict[str, set[str]] = {}
    for mod, deps in imports().items():
        layers.setdefault(layer(mod), set()).update(
            layer(d) for d in deps if layer(d) != layer(mod)
        )
    cycle = find_cycle(layers)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_model_does_not_know_the_ranks_and_the_api_not_the_cli():
    graph = imports()
    for mod, deps in graph.items():
        if mod.startswith("service.model"):
            assert not any(d.startswith("service.ranks") for d in deps), (mod, deps)
        if mod.startswith("service.api"):
            assert not any(d.startswith("service.cli") for d in deps), (mod, deps)
        if layer(mod) == "service.buckets":
            assert deps <= {"service.errors"}, deps


def test_planner_and_api_schemas_import_without_torch():
    code = (
        "import sys, service.buckets, service.cli, service.cli.plan, service.config; "
        "assert 'torch' not in sys.modules, 'planner pulled in torch'"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
