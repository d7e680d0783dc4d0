"""The declared dependencies are the ones the code uses: nothing in requirements.txt or setup.cfg's extras
that nothing imports (an unused dependency costs every install and hides what the package needs).

Reference: the imports of the source tree, parsed with `ast`, mapped to distributions by
`importlib.metadata.packages_distributions()` (the installed packages' own records).
"""

from __future__ import annotations

import ast
import configparser
import functools
import importlib.metadata
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Declared but imported only by a dependency, each with the fact that makes it needed (checked below).
INDIRECT = {
    # tensorflow-datasets declares it for Python < 3.9 only, but its DatasetBuilder.code_path imports it
    # on every Python (tfds_builders.prepare fails without it).
    "importlib-resources": ("tensorflow_datasets", "core/dataset_builder.py", "import importlib_resources"),
    # tensorflow-datasets declares it on Linux only; our builder writes file_format="array_record".
    "array-record": ("tensorflow_datasets", "core/file_adapters.py", "array_record_module.ArrayRecordWriter"),
    # jax declares no dependency on it; jax.export's serialization (respo_jax.exported_programs) imports it.
    "flatbuffers": ("jax", "_src/export/serialization.py", "import flatbuffers"),
}
# Test extras that are not imported: a pytest plugin and the notebooks' Jupyter kernel.
TOOLS = {"pytest-xdist", "ipykernel"}
# Docs extras that Sphinx loads by name from docs/conf.py (an extension, a theme), with the name there.
SPHINX_NAMED = {"myst-parser": "myst_enable_extensions", "myst-nb": '"myst_nb"',
                "sphinx-book-theme": '"sphinx_book_theme"'}


def _dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(lines) -> set[str]:
    names = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(_dist(re.match(r"[A-Za-z0-9._-]+", line).group()))
    return names


def _imported_distributions(*folders: str) -> set[str]:
    """Distributions of every top-level module imported by a .py file under `folders`."""
    modules = set().union(*(_imported_modules(folder) for folder in folders))
    return {_dist(dist) for module in modules for dist in _owners().get(module, ())}


@functools.cache
def _imported_modules(folder: str) -> frozenset[str]:
    modules = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for file in files:
            if not file.endswith(".py"):
                continue
            with open(os.path.join(dirpath, file), encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules.add(node.module.split(".")[0])
    return frozenset(modules)


@functools.cache
def _owners() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def test_every_runtime_requirement_is_imported():
    with open(os.path.join(ROOT, "requirements.txt"), encoding="utf-8") as handle:
        required = _requirement_names(handle)
    unused = required - _imported_distributions("respo_jax", "experiments")
    assert unused == set(INDIRECT), f"declared in requirements.txt, imported nowhere: {sorted(unused)}"
    assert "ml-collections" not in required
    for package, relpath, statement in INDIRECT.values():
        folder = importlib.util.find_spec(package).submodule_search_locations[0]
        with open(os.path.join(folder, relpath), encoding="utf-8") as handle:
            assert statement in handle.read(), (package, relpath, statement)  # else drop the requirement


def test_every_extra_is_imported():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    extras = config["options.extras_require"]
    assert set(extras) == {"test", "docs", "tracking", "bench"}
    imported = _imported_distributions("respo_jax", "experiments", "tests", "docs")
    with open(os.path.join(ROOT, "docs", "conf.py"), encoding="utf-8") as handle:
        conf = handle.read()
    named = {dist for dist, name in SPHINX_NAMED.items() if name in conf}
    for extra in extras:
        unused = _requirement_names(extras[extra].splitlines()) - imported - TOOLS - named
        assert not unused, f"extra [{extra}] declares {sorted(unused)}, imported nowhere"
