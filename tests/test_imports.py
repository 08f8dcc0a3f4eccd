"""The package's import graph: every module imports in a fresh interpreter
without touching the device, and no module depends on itself
through others (a cycle makes import order matter and hides layering mistakes).

Edges count every import statement, at module level or inside a function: a
deferred import still ties the two modules together."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import sparkinfer

ROOT = Path(sparkinfer.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {"sparkinfer": ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix="sparkinfer."):
        rel = Path(*info.name.split(".")[1:])
        path = ROOT / rel / "__init__.py" if info.ispkg else (ROOT / rel).with_suffix(".py")
        mods[info.name] = path
    return mods


def _resolve(name: str, mods: dict) -> str | None:
    """The longest sparkinfer module that `name` names (a.b.C -> a.b when C is not a module)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in `base`
            else:
                continue
            deps |= {t for t in (_resolve(n, mods) for n in targets if n.startswith("sparkinfer")) if t}
        deps.discard(mod)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def test_find_cycle_reports_a_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and "sparkinfer.comm.communicator" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_in_a_fresh_interpreter_without_device_work():
    names = sorted(m for m in _modules() if not m.endswith(".__main__"))  # __main__ runs the CLI
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized(), 'a module touched CUDA at import'\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr[-3000:]
