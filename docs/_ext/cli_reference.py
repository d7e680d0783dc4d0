"""`{cli-help} NAME`: the `--help` of the entry point `python -m NAME`, produced by its own parser at
build time (so a renamed flag or a new one shows without editing a page)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def help_text(name: str) -> str:
    """What `python -m NAME --help` prints (the module docstring for an entry point without a parser)."""
    from experiments.cli import ENTRY_POINTS

    module = importlib.import_module(ENTRY_POINTS[name])
    if name == "respo_jax.symbolic":
        import ast  # its __main__ runs the proofs when imported: read its docstring only

        with open(importlib.util.find_spec("respo_jax.symbolic.__main__").origin, encoding="utf-8") as f:
            return ast.get_docstring(ast.parse(f.read())).strip()
    out = io.StringIO()
    argv0, sys.argv[0] = sys.argv[0], f"python -m {name}"
    try:
        with contextlib.redirect_stdout(out):
            module.main(["--help"])
    except SystemExit:
        pass
    finally:
        sys.argv[0] = argv0
    return out.getvalue().rstrip()


class CliHelp(SphinxDirective):
    required_arguments = 1

    def run(self):
        name = self.arguments[0]
        from experiments.cli import ENTRY_POINTS

        if name not in ENTRY_POINTS:
            raise self.error(f"cli-help: {name!r} is not an entry point ({sorted(ENTRY_POINTS)})")
        text = help_text(name)
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app):
    app.add_directive("cli-help", CliHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
