"""The documentation is checked like code: the Sphinx site builds with warnings as errors, every
`python -m` command line of the README and the site parses with its entry point's own validation, the
config reference is generated from the config classes (a field without a comment fails, a new field
appears), and the pages that list entry points, packages and run-file keys cover them all."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from experiments import cli
from respo_jax.training.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import config_reference  # noqa: E402  (docs/_ext is not a package)

DOC_FILES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
# A project command: `python -m` one of this project's modules (pytest, sphinx, pip are not checked).
COMMAND = re.compile(r"(?:[A-Z_]+=\S+\s+)*\S*python3? -m (?:experiments|respo_jax)\b[^`\n]*")


def documented_commands() -> list[tuple[str, str, str | None]]:
    """(where, command line, the error the page says it gives or None) for every project `python -m`
    command of the README and the site: in code blocks (continuation lines joined) and inline code."""
    found = []
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(ROOT))
        in_block = False
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                in_block = not in_block
                i += 1
                continue
            if in_block:
                joined = line
                while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    joined = joined.rstrip()[:-1] + " " + lines[i].strip()
                match = COMMAND.search(joined)
                if match and "python -c" not in joined:
                    command = match.group(0).split("&&")[0] if "&&" in match.group(0) else match.group(0)
                    nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
                    error = nxt[len("# error: "):] if nxt.startswith("# error: ") else None
                    found.append((where, command.strip(), error))
            else:
                for span in re.findall(r"`([^`]+)`", line):
                    match = COMMAND.fullmatch(span.strip())
                    if match:
                        found.append((where, span.strip(), None))
            i += 1
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_entry_point_kind():
    names = {re.search(r"-m (\S+)", command).group(1) for _, command, _ in COMMANDS}
    assert {"experiments.train", "experiments.evaluate", "experiments.report", "experiments.export",
            "experiments.gradient_starvation", "experiments.mesh_equivalence", "experiments.benchmarks",
            "respo_jax.symbolic"} <= names
    assert len(COMMANDS) > 60
    assert sum(error is not None for _, _, error in COMMANDS) >= 3


@pytest.mark.parametrize("where,command,error", COMMANDS, ids=[f"{w}:{c[:70]}" for w, c, _ in COMMANDS])
def test_documented_command_parses_with_its_entry_points_validation(where, command, error):
    words = command.split()
    if words[-2] == "-m":  # the entry point named, without arguments
        assert words[-1] in cli.ENTRY_POINTS, f"{where}: python -m {words[-1]} is not an entry point"
        return
    if error is None:
        cli.check_command(command)
        return
    with pytest.raises((ConfigError, ValueError)) as err:  # the page shows the error it gives
        cli.check_command(command)
    expected = re.split(r"\[\.\.\.\]|\s{2,}", error)[0].strip()
    assert str(err.value).startswith(expected), (str(err.value), expected)


def test_a_renamed_key_or_flag_fails_the_command_check():
    cli.check_command("python -m experiments.train rollout.reuse=8 run.out_dir=runs/x")
    with pytest.raises(ConfigError, match="rollout.reuse_ratio"):
        cli.check_command("python -m experiments.train rollout.reuse_ratio=8")
    with pytest.raises(ConfigError, match="unknown config key 'task.reward_name'"):  # a user's config file
        cli.check_command("python -m experiments.train --config my_reward.py task.reward_name=has_box")
    with pytest.raises(ConfigError, match="--stepp"):
        cli.check_command("python -m experiments.export RUN OUT --stepp 3")
    with pytest.raises(ConfigError, match="eval.top_p"):
        cli.check_command("python -m experiments.evaluate eval.checkpoint=runs/x eval.top_p=2")
    with pytest.raises(ConfigError, match="not an entry point"):
        cli.check_command("python -m experiments.trian")


def test_every_entry_point_is_registered_and_on_the_cli_page():
    mains = set()
    for path in list((ROOT / "experiments").rglob("*.py")):
        if '__name__ == "__main__"' in path.read_text(encoding="utf-8"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mains.add(module.removesuffix(".__main__"))
    assert mains == {name for name in cli.ENTRY_POINTS if name.startswith("experiments")}
    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    assert set(re.findall(r"\{cli-help\} (\S+)", page)) == set(cli.ENTRY_POINTS)


def test_every_public_package_has_an_api_page():
    import respo_jax

    pages = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.md"))
    documented = set(re.findall(r"automodule:: (\S+)", pages))
    for info in __import__("pkgutil").iter_modules(respo_jax.__path__):
        name = f"respo_jax.{info.name}"
        if name == "respo_jax.training":  # a package of modules: its page includes every one, generated
            assert "_generated/api_training.md" in pages
            continue
        if name == "respo_jax.models":
            name = "respo_jax.models.qwen3"
        assert name in documented, f"{name} has no API page under docs/api"


# ------------------------------------------------------------------------ the generated config reference

@dataclasses.dataclass(frozen=True)
class _Section:
    section = "demo"
    # the first knob
    alpha: int = 1
    beta: str = "b"  # the second knob
    gamma: float = 0.5


@dataclasses.dataclass(frozen=True)
class _Config:
    demo: _Section = _Section()


def test_config_reference_takes_each_meaning_from_the_field_comment_and_refuses_a_field_without_one():
    with pytest.raises(config_reference.UndocumentedField, match=r"demo\.gamma"):
        config_reference.section_fields(_Section, "demo")

    @dataclasses.dataclass(frozen=True)
    class Documented:
        """gamma: the third knob, from the docstring."""

        # the first knob,
        # over two lines
        alpha: int = 1
        beta: str = "b"  # the second knob
        gamma: float = 0.5
        delta: dict = dataclasses.field(default_factory=lambda: {"k": 1})  # a dict knob

    fields = config_reference.section_fields(Documented, "demo")
    assert [(f.key, f.type, f.default, f.meaning) for f in fields] == [
        ("demo.alpha", "int", "1", "the first knob, over two lines"),
        ("demo.beta", "str", "'b'", "the second knob"),
        ("demo.gamma", "float", "0.5", "the third knob, from the docstring."),
        ("demo.delta", "dict", "{'k': 1}", "a dict knob"),
    ]


def test_config_reference_lists_every_field_of_every_section_of_every_config():
    for name, config_path in config_reference.GENERATED.items():
        text = config_reference.config_markdown(config_path)
        module, cls = config_path.split(":")
        config = getattr(importlib.import_module(module), cls)
        for section, section_cls in config_reference.config_sections(config):
            assert f"## `{section}`" in text
            for field in dataclasses.fields(section_cls):
                assert f"| `{section}.{field.name}` |" in text, (name, section, field.name)
        assert f"_generated/{name}" in (DOCS / "reference" / "config.md").read_text(encoding="utf-8")


def test_a_new_config_field_appears_in_the_reference_without_editing_a_page(monkeypatch):
    from respo_jax.training import config as training_config

    @dataclasses.dataclass(frozen=True)
    class Extended(training_config.RunConfig):
        # a knob added after the docs were written
        brand_new_knob: int = 7

    hints = dict(training_config.ExperimentConfig.__annotations__)
    monkeypatch.setattr(training_config.ExperimentConfig, "__annotations__", {**hints, "run": Extended})
    text = config_reference.config_markdown("respo_jax.training.config:ExperimentConfig")
    assert "| `run.brand_new_knob` | `int` | `7` | a knob added after the docs were written |" in text


# ------------------------------------------------------------------------------ the pages about a run

def test_run_directory_page_lists_every_key_a_trained_run_writes(reference):
    page = (DOCS / "reference" / "run_directory.md").read_text(encoding="utf-8")
    listed = {span.split("/")[0] for span in re.findall(r"`([^`]+)`", page)}  # a key, or a file's name
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    written = set().union(*records) | set(json.loads((reference / "summary.json").read_text()))
    written |= set(json.loads((reference / "run_info.json").read_text()))
    import numpy as np

    for rollout in sorted((reference / "rollouts").glob("*.npz")):
        written |= set(np.load(rollout).files)
    written |= {p.name for p in reference.iterdir() if p.name != ".lock"}
    assert {"config.json", "metrics.jsonl", "checkpoints", "rollouts", "sampled_pass_at_1"} <= listed
    assert written - listed == set(), f"on the run directory page: {sorted(written - listed)}"


def test_readme_is_a_front_page_opening_with_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 150
    blocks = [readme[2:5], readme[6:9]]
    assert blocks[0][1] == ("python3 -m venv .venv && .venv/bin/pip install -q -e . && "
                            ".venv/bin/python -m experiments.train")
    test_command = blocks[1][1]
    assert test_command == ('python3 -m venv .venv && .venv/bin/pip install -q -e ".[test,docs]" && '
                            ".venv/bin/python -m pytest -n 2 -q")
    assert test_command in (ROOT / ".ci" / "run").read_text(encoding="utf-8")  # CI runs exactly it
    for stale in ("race", "2026-", "Measured here"):  # no measurement history on the front page
        assert stale not in "\n".join(readme)
    for target in re.findall(r"\]\(([^)#]+)\)", "\n".join(readme)):  # its links lead somewhere
        assert (ROOT / target).exists(), target


# ------------------------------------------------------------------------------------- the site builds

@pytest.mark.slow  # over 9 s: in the full suite, not the fast path
def test_sphinx_site_builds_with_warnings_as_errors(tmp_path):
    """`sphinx-build -W` into a fresh directory, the notebooks rendered as stored (not executed)."""
    out = tmp_path / "html"
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d",
         str(tmp_path / "doctrees"), str(DOCS), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-5000:]
    for page in ("index", "getting_started", "architecture", "reference/config", "reference/cli",
                 "reference/run_directory", "api/objectives", "api/training", "results/gradient_starvation",
                 "results/benchmarks", "notebooks/derivations", "guides/sharding"):
        assert (out / f"{page}.html").is_file(), page
    config_page = (out / "reference" / "config.html").read_text(encoding="utf-8")
    assert "rollout.reuse" in config_page and "eval.top_p" in config_page and "sweep.reuse" in config_page
    cli_page = (out / "reference" / "cli.html").read_text(encoding="utf-8")
    assert "usage: python -m experiments.export" in cli_page
    guides = (out / "guides" / "index.html").read_text(encoding="utf-8")
    for guide in sorted((DOCS / "guides").glob("*.md")):  # the glob toctree takes every guide
        if guide.stem != "index":
            assert f'href="{guide.stem}.html"' in guides, guide.stem


def test_sphinx_build_fails_on_a_broken_cross_reference(tmp_path):
    """What -W catches: a page whose link has no target fails the build (a one-page site with this
    site's configuration and extensions)."""
    import shutil

    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(DOCS / "conf.py", docs / "conf.py")
    shutil.copytree(DOCS / "_ext", docs / "_ext")
    (docs / "index.md").write_text("# Site\n\nSee {doc}`no_such_page`.\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d",
         str(tmp_path / "doctrees"), str(docs), str(tmp_path / "html")], cwd=ROOT, capture_output=True,
        text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert result.returncode != 0 and "no_such_page" in result.stderr, result.stderr[-3000:]
    assert (docs / "reference" / "_generated" / "config_train.md").is_file()  # the extension ran
