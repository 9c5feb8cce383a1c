"""The package's import graph has no cycle: every import counts, those inside functions too,
so that no module dodges a cycle by importing late. An import of `pkg.mod` (or of a name
from it) is an edge to that module, as import linters draw it; a package's __init__ that
registers its submodules is not a cycle with them."""
import ast
from pathlib import Path

import moagen

PACKAGE = Path(moagen.__file__).resolve().parent


def modules() -> dict:
    """Dotted name -> path of every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(module: str, path: Path, known: dict) -> set:
    """The package's modules that `module` imports anywhere in its text."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name from a module: that module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_imports_no_module_that_imports_it_back():
    known = modules()
    graph = {m: imported(m, p, known) for m, p in known.items()}
    assert cycles(graph) == []


def test_a_cycle_is_found_wherever_the_import_is():
    """The check itself: a cycle closed by an import inside a function is still one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_inside_a_function_is_an_edge(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from moagen.pipeline import onf_of\n")
    assert imported("moagen.x", path, {"moagen.pipeline": None, "moagen.x": None}) == \
        {"moagen.pipeline"}
