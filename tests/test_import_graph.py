"""The import graph of `respo_jax` and `experiments` has no cycle: modules are layered, so each can be read,
imported and tested on top of the ones below it.

The graph is read statically (`ast`, nothing is imported): an edge A -> B for every `import` or `from ...
import` in A naming module B of the project (`from P import name` names the submodule P.name when there
is one, else P). Imports inside functions count like the others: a deferred import is a cycle postponed to
run time (the two modules still need each other), and the cycles this test was written against hid there.
Two levels are checked: modules, and the package graph (each subpackage of `respo_jax`, e.g.
`respo_jax.training`, and each top-level module is one node), where `training` importing `eval` while
`eval` imports `training` is a cycle though no two modules form one.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("respo_jax", "experiments")

# Imports that close a cycle known and being removed elsewhere, each with its reason. The checks leave
# these edges out; a listed edge that is gone fails the test (so its entry goes with it).
KNOWN_CYCLE_EDGES: dict = {}


def project_modules(root: pathlib.Path = ROOT) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(modules: dict[str, tuple[pathlib.Path, bool]]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at module level or inside a function)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                resolved = resolve(target)
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def package_of(module: str) -> str:
    """The package-graph node of a module: `respo_jax.<subpackage or module>`, `experiments.<...>`."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package_of(module), set())
        for target in targets:
            if package_of(target) != package_of(module):
                packages[package_of(module)].add(package_of(target))
    return packages


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset]:
    """The components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def a_cycle(graph: dict[str, set[str]], component: frozenset) -> list[str]:
    """One cycle through the component, as a path that ends where it starts (for the failure message)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the component, until an edge leads back to the start
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not a cycle")


def cycles_message(graph: dict[str, set[str]], components: list[frozenset]) -> str:
    return "; ".join(" -> ".join(a_cycle(graph, component)) for component in components)


@pytest.fixture(scope="module")
def graph():
    return import_graph(project_modules())


def test_the_reader_finds_the_imports_of_every_form(tmp_path):
    package = tmp_path / "respo_jax"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "a.py": "import respo_jax.b\n",
        "b.py": "from respo_jax.sub import c\n",
        "sub/__init__.py": "from .c import thing\n",
        "sub/c.py": "def f():\n    from ..a import name\n",
        "sub/d.py": "from respo_jax import sub\nimport json\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = import_graph({name: entry for name, entry in project_modules(tmp_path).items()})
    assert graph == {"respo_jax": set(), "respo_jax.a": {"respo_jax.b"}, "respo_jax.b": {"respo_jax.sub.c"},
                     "respo_jax.sub": {"respo_jax.sub.c"}, "respo_jax.sub.c": {"respo_jax.a"},
                     "respo_jax.sub.d": {"respo_jax.sub"}}
    components = strongly_connected(graph)
    assert components == [frozenset({"respo_jax.a", "respo_jax.b", "respo_jax.sub.c"})]
    assert cycles_message(graph, components) == "respo_jax.a -> respo_jax.b -> respo_jax.sub.c -> respo_jax.a"
    assert package_graph(graph) == {"respo_jax": set(), "respo_jax.a": {"respo_jax.b"},
                                    "respo_jax.b": {"respo_jax.sub"}, "respo_jax.sub": {"respo_jax.a"}}


def test_the_graph_covers_both_packages(graph):
    assert "respo_jax.training.loop" in graph and "experiments.train" in graph
    assert "respo_jax.config.typed" in graph["respo_jax.training.config"]


def without_known_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    gone = [edge for edge in KNOWN_CYCLE_EDGES if edge[1] not in graph.get(edge[0], ())]
    assert not gone, f"these imports are gone; remove them from KNOWN_CYCLE_EDGES: {gone}"
    return {module: targets - {b for a, b in KNOWN_CYCLE_EDGES if a == module}
            for module, targets in graph.items()}


def test_no_module_imports_itself_through_others(graph):
    checked = without_known_edges(graph)
    components = strongly_connected(checked)
    assert not components, f"import cycles: {cycles_message(checked, components)}"


def test_no_package_imports_itself_through_others(graph):
    packages = package_graph(without_known_edges(graph))
    components = strongly_connected(packages)
    assert not components, f"package import cycles: {cycles_message(packages, components)}"


def test_the_config_package_sits_below_training_and_evaluation(graph):
    """`respo_jax.config` (the sections training and evaluation share) reaches no module of either, even
    through the lower layers its validators read (the sampler's constants, the mesh)."""
    reached, frontier = set(), [module for module in graph if module.startswith("respo_jax.config")]
    while frontier:
        module = frontier.pop()
        for target in graph[module] - reached:
            reached.add(target)
            frontier.append(target)
    above = sorted(module for module in reached if module.startswith(("respo_jax.training", "respo_jax.eval",
                                                                    "experiments")))
    assert not above, above
    assert any(t.startswith("respo_jax.config") for t in graph["respo_jax.eval.config"])
    assert any(t.startswith("respo_jax.config") for t in graph["respo_jax.training.config"])


def test_evaluation_builds_on_config_not_on_training(graph):
    """The evaluation and its reports read a training run's config through `respo_jax.config`, so the
    trainer may use the evaluation's modules (its rollout files) without a cycle."""
    into_training = sorted(f"{module} -> {target}" for module, targets in graph.items()
                           if module.startswith("respo_jax.eval") for target in targets
                           if target.startswith("respo_jax.training"))
    assert not into_training, into_training
