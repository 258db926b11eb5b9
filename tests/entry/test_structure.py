"""The package's shape: imports flow one way (no circles, function-level imports included) and
nothing in the library leans on test harness code."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatrain_ray"
HARNESS = {"megatrain_ray.runtime.local"}  # the in-process trainer, for tests
TOP = {"megatrain_ray.cli", "megatrain_ray.api", "megatrain_ray"}  # entry points may reach everything


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every megatrain_ray module this file imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatrain_ray"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_circles():
    graph = {name: deps - {"megatrain_ray"} for name, deps in import_graph().items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_library_module_imports_test_harness_or_the_benchmark():
    for name, deps in import_graph().items():
        if name in TOP or name in HARNESS or name.startswith("megatrain_ray.bench"):
            continue
        assert not deps & HARNESS, f"{name} imports {deps & HARNESS}"
        assert not {d for d in deps if d.startswith("megatrain_ray.bench")}, f"{name} imports the benchmark"
