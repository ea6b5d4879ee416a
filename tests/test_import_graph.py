"""The import graph of the library has no circles (docs/architecture.md: every import points down).

Every `import` statement of every module counts, wherever it stands: at the top, inside a function
(a function-local import is still a dependency, only a later one) or under `TYPE_CHECKING`. An
import names the most specific module file it reaches: `from a.b import c` is an edge to `a/b/c.py`
when that file exists, else to `a/b/__init__.py`. Tests are outside the graph (they may import
anything). `python -m tests.test_import_graph` prints the modules, edges and circles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("clover_jax", "decoding", "weights", "pallas_kernels", "benchmarks", "scripts")

# Nothing is left out of the graph (the serving engine's rebuild cut the last circles: engine <->
# precompile, benchmarks/serving <-> serving_burst); a path here would be left out with its reason.
EXCLUDED: tuple[str, ...] = ()


def module_files(root: Path = ROOT, excluded: tuple[str, ...] = EXCLUDED) -> dict[str, Path]:
    """Dotted module name -> its file, for every Python file of `PACKAGES` not `excluded`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith(excluded):
                continue
            parts = relative.removesuffix(".py").split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Every dotted name an import statement of the module reaches, `from x import y` as `x.y`."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT, excluded: tuple[str, ...] = EXCLUDED) -> dict[str, set[str]]:
    """Module -> the modules of the graph it imports (each name resolved to its longest module prefix)."""
    modules = module_files(root, excluded)
    known = set(module_files(root, ()))  # an import of an excluded module is no edge, and no error
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for name in _imported_names(tree, module, path.name == "__init__.py"):
            parts = name.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            target = ".".join(parts)
            if target in modules and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        # iterative: the graph's depth would not trouble recursion, but the stack stays explicit
        work = [(node, iter(sorted(graph[node])))]
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        while work:
            current, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[current] = min(low[current], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_of(module: str) -> str:
    """The package a module belongs to, as docs/architecture.md draws them: `clover_jax`'s subpackages
    (`clover_jax.api`, `clover_jax.training`, ...) one by one, the package's own `__init__` and
    `__main__` as `clover_jax`, and every other top-level package whole."""
    parts = module.split(".")
    if parts[0] == "clover_jax" and len(parts) > 1 and parts[1] != "__main__":
        return ".".join(parts[:2])
    return parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(other) for other in imported if package_of(other) != package_of(module))
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    return packages


def _described(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join("  " + ", ".join(f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component)
                     for component in found)


def test_the_library_has_no_import_circles():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles (cut each by moving the shared names down):\n" + _described(graph, found)


def test_no_two_packages_import_each_other():
    # e.g. `api` and `training`: the entry points import the trainer, which imports neither of them back
    packages = package_graph(import_graph())
    found = circles(packages)
    assert not found, "packages in a circle:\n" + _described(packages, found)


def test_a_circle_is_found_through_a_function_local_import(tmp_path):
    # the walker must see what the library's own circles were made of: a top-level import one way,
    # a function-local `from package import module` the other, and a relative import
    package = tmp_path / "clover_jax"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from clover_jax import high\n    return high\n")
    (package / "high.py").write_text("from .low import f\n")
    (package / "alone.py").write_text("import clover_jax.low\n")
    graph = import_graph(tmp_path)
    assert graph["clover_jax.high"] == {"clover_jax.low"}
    assert graph["clover_jax.alone"] == {"clover_jax.low"}
    assert circles(graph) == [["clover_jax.high", "clover_jax.low"]]


def test_packages_in_a_circle_are_found(tmp_path):
    for name, text in {"a/__init__.py": "", "a/x.py": "import b.y\n", "b/__init__.py": "", "b/y.py": "",
                       "b/z.py": "from a import x\n"}.items():
        (tmp_path / "clover_jax" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "clover_jax" / name).write_text(text.replace("import b", "import clover_jax.b").replace(
            "from a", "from clover_jax.a"))
    graph = import_graph(tmp_path)
    assert circles(graph) == []  # no module circle: x -> y, z -> x
    assert circles(package_graph(graph)) == [["clover_jax.a", "clover_jax.b"]]


def test_every_excluded_path_still_names_files():
    # an exclusion that no longer matches anything (the files moved, or the circle was cut) must go
    everything = module_files(ROOT, ())
    for prefix in EXCLUDED:
        assert any(path.relative_to(ROOT).as_posix().startswith(prefix) for path in everything.values()), prefix


def main() -> None:
    excluded = () if "--all" in sys.argv else EXCLUDED
    graph = import_graph(ROOT, excluded)
    print("excluded: " + (", ".join(excluded) or "nothing"))
    for name, shown in (("modules", graph), ("packages", package_graph(graph))):
        found = circles(shown)
        print(f"{name} {len(shown)}, edges {sum(map(len, shown.values()))}, circles {len(found)}")
        if found:
            print(_described(shown, found))


if __name__ == "__main__":
    main()
