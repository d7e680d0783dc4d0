"""The config reference, generated from the typed config classes (one source, so it cannot drift).

Every field of every section gets its key, type, default and meaning. The meaning is the `#` comment
block directly above the field, else the comment on the field's own line, else the field's entry in
its class docstring (`name: meaning`, or `a / b / c: meaning` for a group). A field with none of the
three fails the build, so a new field cannot ship undocumented, and a new field or section appears in
the reference without editing a page.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import os
import re
import textwrap
import tokenize
import typing


class UndocumentedField(ValueError):
    """A config field with no comment and no docstring entry."""


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str  # section.field
    type: str  # the annotation as written
    default: str  # repr of the default (a factory's value)
    meaning: str  # one paragraph


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based) -> the text of the `#` comment on that line."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _docstring_entries(doc: str) -> dict[str, str]:
    """`name: meaning` entries of a class docstring (continuation lines indented further; `a / b: ...`
    and `a, b: ...` give the meaning to each name)."""
    entries: dict[str, str] = {}
    current: list[str] | None = None
    names: list[str] = []
    for line in inspect.cleandoc(doc).splitlines():
        match = re.match(r"^([A-Za-z_]\w*(?:\s*[/,]\s*[A-Za-z_]\w*)*):\s+(\S.*)$", line)
        if match and not line.startswith(" "):
            names = [n.strip() for n in re.split(r"[/,]", match.group(1))]
            current = [match.group(2)]
            for name in names:
                entries[name] = ""
        elif current is not None and line.startswith(" ") and line.strip():
            current.append(line.strip())
        else:
            current = None
        if current is not None:
            for name in names:
                entries[name] = " ".join(current)
    return entries


def _source_fields(cls: type) -> dict[str, tuple[str, str]]:
    """field name -> (its annotation as written, its meaning from the comments; '' if none)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments(source)
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        inline = " ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments)
        out[node.target.id] = (ast.unparse(node.annotation), " ".join(above) or inline)
    return out


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


def section_fields(cls: type, section: str) -> list[FieldDoc]:
    """The documented fields of one section class; UndocumentedField names the first without a meaning."""
    written: dict[str, tuple[str, str]] = {}
    from_doc: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # a subclass wins
        written.update(_source_fields(klass))
        from_doc.update(_docstring_entries(klass.__doc__ or ""))
    docs = []
    for field in dataclasses.fields(cls):
        annotation, meaning = written.get(field.name, ("", ""))
        meaning = meaning or from_doc.get(field.name, "")
        if not meaning:
            raise UndocumentedField(
                f"{cls.__module__}.{cls.__qualname__}.{field.name} ({section}.{field.name}) has no meaning: "
                "write a # comment above the field")
        docs.append(FieldDoc(f"{section}.{field.name}", annotation, _default(field), meaning))
    return docs


def config_sections(config_cls: type) -> list[tuple[str, type]]:
    """(section name, section class) of a top-level config (ExperimentConfig, EvalConfig, ...)."""
    hints = typing.get_type_hints(config_cls)
    return [(field.name, hints[field.name]) for field in dataclasses.fields(config_cls)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_markdown(config_path: str, heading_level: int = 2) -> str:
    """The reference of one top-level config class (`module:Class`) as MyST Markdown: a heading per
    section, its docstring's summary and a table of its fields."""
    module_name, class_name = config_path.split(":")
    config_cls = getattr(importlib.import_module(module_name), class_name)
    out = []
    for section, cls in config_sections(config_cls):
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        out += [f"{'#' * heading_level} `{section}`", "", f"`{cls.__module__}.{cls.__qualname__}`: {summary}",
                "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for doc in section_fields(cls, section):
            cells = (f"`{doc.key}`", f"`{_cell(doc.type)}`", f"`{_cell(doc.default)}`", _cell(doc.meaning))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        rest = (inspect.getdoc(cls) or "").split("\n\n", 1)[1:]
        if rest:  # the section's docstring beyond its summary, as written
            out += ["```text", rest[0].strip("\n"), "```", ""]
    return "\n".join(out)


def sharding_rules_markdown() -> str:
    """The default `respo_jax.sharding.ShardingRules` as a table: logical axis -> mesh axes."""
    from respo_jax.sharding import ShardingRules

    rules = ShardingRules()
    out = ["| logical axis | mesh axes |", "|---|---|"]
    for field in dataclasses.fields(rules):
        value = getattr(rules, field.name)
        names = (value,) if isinstance(value, str) else value
        axes = "not split" if value is None else ", ".join(f"`{a}`" for a in names)
        out.append(f"| `{field.name}` | {axes} |")
    return "\n".join(out + [""])


def kernel_defaults_markdown() -> str:
    """The per-platform kernel defaults of `respo_jax.models.qwen3.kernels` as a table."""
    from respo_jax.models.qwen3 import kernels

    platforms = ("cpu", "gpu", "tpu")
    choices = {p: dict(kernels.default_kernels(p), lm_head_impl=kernels.default_lm_head_impl(p, 1))
               for p in platforms}
    out = ["| field | " + " | ".join(platforms) + " |", "|---|" + "---|" * len(platforms)]
    for field in choices["cpu"]:
        out.append(f"| `{field}` | " + " | ".join(f"`{choices[p][field]}`" for p in platforms) + " |")
    return "\n".join(out + [""])


def package_modules_markdown(package: str) -> str:
    """An autodoc section per module of `package` (a new module gets its section without editing a page)."""
    import pkgutil

    out = []
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        name = f"{package}.{info.name}"
        out += [f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", "   :members:", "```", ""]
    return "\n".join(out)


# The reference pages' generated parts: file under docs/reference/_generated -> the config class.
GENERATED = {
    "config_train.md": "respo_jax.training.config:ExperimentConfig",
    "config_eval.md": "respo_jax.eval.config:EvalConfig",
    "config_sweep.md": "experiments.gradient_starvation:StarvationConfig",
}


def write_generated(srcdir: str) -> list[str]:
    """Writes the generated reference parts under `srcdir/reference/_generated` (a file is rewritten only
    when its text changes, so an unchanged build reads it as unchanged)."""
    folder = os.path.join(srcdir, "reference", "_generated")
    os.makedirs(folder, exist_ok=True)
    written = []
    texts = {name: config_markdown(config_path) for name, config_path in GENERATED.items()}
    texts["sharding_rules.md"] = sharding_rules_markdown()
    texts["kernel_defaults.md"] = kernel_defaults_markdown()
    texts["api_training.md"] = package_modules_markdown("respo_jax.training")
    for name, text in texts.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or open(path, encoding="utf-8").read() != text:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        written.append(path)
    return written


def _builder_inited(app) -> None:
    from sphinx.errors import ExtensionError

    try:
        write_generated(app.srcdir)
    except UndocumentedField as err:
        raise ExtensionError(str(err)) from None


def _docstring_as_written(app, what, name, obj, options, lines) -> None:
    """The project's docstrings are plain text (shapes, equations, code), not reStructuredText: show
    them as written, in a literal block."""
    if lines and any(line.strip() for line in lines):
        text = list(lines)
        lines[:] = ["::", ""] + ["   " + line for line in text] + [""]


def setup(app):
    app.connect("builder-inited", _builder_inited)
    app.connect("autodoc-process-docstring", _docstring_as_written)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
