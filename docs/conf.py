"""Sphinx configuration of the respo-jax documentation (MyST Markdown, myst-nb notebooks, autodoc API)."""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "respo-jax"
author = "respo-jax authors"
copyright = "respo-jax authors"

extensions = [
    "myst_nb",  # MyST Markdown pages and the notebooks
    "sphinx.ext.autodoc",
    "config_reference",  # the config reference, generated from the typed config classes
    "cli_reference",  # the --help of every entry point
]

# The notebooks are rendered as stored (without outputs): tests/test_notebooks.py executes them and
# checks what they show, so the docs build does not run them again.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "reference/_generated/*"]

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "none"  # signatures as written; the docstrings carry the shapes
autodoc_member_order = "bysource"

html_theme = "sphinx_book_theme"
html_title = "respo-jax"
html_theme_options = {"show_toc_level": 2, "home_page_in_toc": True}
