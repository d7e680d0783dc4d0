"""Export a training run's policy as a Hugging Face directory: safetensors, config.json and the tokenizer
files, which `transformers.AutoModelForCausalLM.from_pretrained` and vLLM load.

    python -m experiments.export RUN_DIR OUT_DIR               # the latest intact checkpoint
    python -m experiments.export RUN_DIR OUT_DIR --step 300    # a chosen checkpoint step
    python -m experiments.export RUN_DIR OUT_DIR --overwrite   # replace what OUT_DIR holds

RUN_DIR is a run directory of `python -m experiments.train` (its config.json and checkpoints/). The
weights are the checkpoint's parameters in their stored dtype, written by `qwen3.save_pretrained`. The
tokenizer files are the run's own: a `dapo_math` run's tokenizer directory (`task.tokenizer_dir`) is
copied; a synthetic-task run's character tokenizer is written as a `tokenizer.json` that encodes and
decodes as `respo_jax.data.synthetic.CharTokenizer` does. A damaged newest checkpoint is reported and the
newest intact one is exported. A bad input (not a run, no such step, a non-empty OUT_DIR without
--overwrite) is one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from experiments.cli import ArgumentParser, run_cli
from respo_jax.runs import CHECKPOINT_DIR, CONFIG_FILE
from respo_jax.training.config import ConfigError

# The tokenizer files a Hugging Face directory may hold, copied from a run's tokenizer directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def char_tokenizer_files(tokenizer) -> dict[str, str]:
    """`tokenizer.json` and `tokenizer_config.json` (as text) of a `CharTokenizer`: one token per
    character, the specials <pad>, <bos>, <eos> first, decoded by concatenation."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from respo_jax.data.synthetic import SPECIAL_TOKENS

    vocab = {tokenizer.decode([i], skip_special_tokens=False): i for i in range(tokenizer.vocab_size)}
    hf = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(list(SPECIAL_TOKENS))
    pad, bos, eos = (SPECIAL_TOKENS[i] for i in (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad, "bos_token": bos,
              "eos_token": eos, "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000}
    return {"tokenizer.json": hf.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2)}


def _refuse(message: str) -> ConfigError:
    return ConfigError(message)


def read_run_config(run_dir: str):
    """The run's `ExperimentConfig` from its config.json; ConfigError (one line) when `run_dir` is not a
    run directory."""
    from respo_jax.training.config import ExperimentConfig, config_from_dict

    if not os.path.isdir(run_dir):
        raise _refuse(f"RUN_DIR {run_dir!r}: no such directory")
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path) or not os.path.isdir(os.path.join(run_dir, CHECKPOINT_DIR)):
        raise _refuse(f"RUN_DIR {run_dir!r}: not a training run directory (expected {CONFIG_FILE} and "
                      f"{CHECKPOINT_DIR}/)")
    try:
        with open(path, encoding="utf-8") as f:
            return config_from_dict(ExperimentConfig, json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise _refuse(f"RUN_DIR {run_dir!r}: its {CONFIG_FILE} does not read as a run's config ({err})") \
            from None


def run_tokenizer(config):
    """The run's tokenizer: the synthetic task's `CharTokenizer`, or the HF one of task.tokenizer_dir."""
    from respo_jax.data.synthetic import CharTokenizer
    from respo_jax.data.tokenizer import load_tokenizer

    if config.task.name == "synthetic":
        return CharTokenizer()
    try:
        return load_tokenizer(config.task.tokenizer_dir)
    except (OSError, ValueError) as err:
        raise _refuse(f"the run's tokenizer (task.tokenizer_dir={config.task.tokenizer_dir!r}): {err}") \
            from None


def load_run_model(run_dir: str, step: int | None = None, report=None):
    """(model, step, config, tokenizer): the run's policy with the parameters of checkpoint `step`, or of
    the newest intact checkpoint (damaged newer steps reported through `report`, default stderr)."""
    from flax import nnx

    from respo_jax.training.checkpoint import CheckpointError, list_steps, restore_params
    from respo_jax.training.model_setup import build_model

    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    config = read_run_config(run_dir)
    checkpoints = os.path.join(run_dir, CHECKPOINT_DIR)
    steps = list_steps(checkpoints)
    if not steps:
        raise _refuse(f"RUN_DIR {run_dir!r}: no checkpoint under {checkpoints}")
    if step is not None and step not in steps:
        raise _refuse(f"--step {step}: not a checkpoint step of {run_dir!r} (steps {steps})")
    tokenizer = run_tokenizer(config)
    abstract = nnx.eval_shape(lambda: build_model(config, tokenizer.vocab_size))
    graphdef, abstract_state = nnx.split(abstract)
    for candidate in ([step] if step is not None else list(reversed(steps))):
        try:
            params, _, _ = restore_params(checkpoints, abstract_state, candidate)
        except CheckpointError as err:
            if step is not None:
                raise _refuse(f"--step {step}: {err}") from None
            report(f"warning: {err}; trying an earlier checkpoint")
            continue
        return nnx.merge(graphdef, params), candidate, config, tokenizer
    raise _refuse(f"RUN_DIR {run_dir!r}: no intact checkpoint (steps {steps} are all damaged)")


def write_tokenizer(config, tokenizer, out_dir: str) -> list[str]:
    """The run's tokenizer files into `out_dir`; returns their names."""
    if config.task.name == "synthetic":
        files = char_tokenizer_files(tokenizer)
        for name, text in files.items():
            with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
                f.write(text)
        return sorted(files)
    copied = []
    for name in TOKENIZER_FILES:
        source = os.path.join(config.task.tokenizer_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(out_dir, name))
            copied.append(name)
    return copied


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """OUT_DIR is absent, empty, or (with --overwrite) a directory whose files may be replaced."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise _refuse(f"OUT_DIR {out_dir!r}: exists and is not a directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise _refuse(f"OUT_DIR {out_dir!r}: not empty (pass --overwrite to replace its contents)")


def export(run_dir: str, out_dir: str, step: int | None = None, overwrite: bool = False) -> dict:
    """Writes the run's checkpoint `step` (None: the newest intact one) to `out_dir` as a Hugging Face
    directory; returns what was written ({"step", "files"})."""
    from respo_jax.models import qwen3

    check_out_dir(out_dir, overwrite)
    model, step, config, tokenizer = load_run_model(run_dir, step)
    if os.path.isdir(out_dir) and overwrite:
        shutil.rmtree(out_dir)
    partial = out_dir.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    qwen3.save_pretrained(model, partial)
    files = sorted(os.listdir(partial)) + write_tokenizer(config, tokenizer, partial)
    os.replace(partial, out_dir)  # a killed export leaves OUT_DIR.partial, never a half-written OUT_DIR
    return {"step": step, "files": sorted(set(files))}


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="python -m experiments.export", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face directory to write")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint step to export (default: the newest intact one)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR's contents")
    args = parser.parse_args(argv)
    written = export(args.run_dir, args.out_dir, args.step, args.overwrite)
    files = ", ".join(written["files"])
    print(f"exported step {written['step']} of {args.run_dir} to {args.out_dir}: {files}")
    return written


def cli(argv: list[str]) -> int:
    """`main` for the command line: a bad input is one line on stderr and exit status 2."""
    from respo_jax.training.checkpoint import CheckpointError

    return run_cli(main, argv, failures=(CheckpointError, OSError))


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
