"""`python -m experiments.export`: a trained run becomes a Hugging Face directory that `transformers` loads
with the same logits as the run's model and a tokenizer that encodes as the run's; a damaged newest
checkpoint falls back to the newest intact one; bad inputs are one line and exit status 2."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import export
from experiments.cli import run_cli
from respo_jax.data.synthetic import CharTokenizer
from tiny_runs import flip_a_bit

PROMPTS = ["3+4-2=", "9-1+5= \\boxed{"]


def transformers_logits(hf_dir, ids: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_export_loads_in_transformers_with_the_runs_logits_and_tokenizer(reference, tmp_path, capsys):
    import transformers

    out = tmp_path / "hf"
    assert run_cli(export.main, [str(reference), str(out)]) == 0
    assert "exported step 8 " in capsys.readouterr().out  # the newest checkpoint (3, 6, 8)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    char = CharTokenizer()
    for text in PROMPTS:
        ids = char.encode(text)
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
        assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token_id == char.eos_id and hf_tokenizer.pad_token_id == char.pad_id

    model, step, _, _ = export.load_run_model(str(reference))
    assert step == 8
    ids = [char.bos_id] + char.encode(PROMPTS[1])
    ours = np.asarray(model(jnp.asarray([ids]))[0])
    theirs = transformers_logits(out, ids)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-5)
    # Not the initial weights: step 3's parameters give other logits.
    earlier, _, _, _ = export.load_run_model(str(reference), step=3)
    assert np.abs(np.asarray(earlier(jnp.asarray([ids]))[0]) - ours).max() > 1e-4


def test_export_falls_back_past_a_damaged_checkpoint_and_takes_a_chosen_step(reference, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    flip_a_bit(run / "checkpoints" / "8")
    assert run_cli(export.main, [str(run), str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert "exported step 6 " in captured.out and "checkpoint step 8" in captured.err
    assert run_cli(export.main, [str(run), str(tmp_path / "hf3"), "--step", "3"]) == 0
    assert "exported step 3 " in capsys.readouterr().out
    # The chosen step damaged: refused, not replaced by another.
    assert run_cli(export.main, [str(run), str(tmp_path / "hf8"), "--step", "8"]) == 2
    assert not (tmp_path / "hf8").exists()


@pytest.mark.parametrize("case", ["not_a_run", "missing", "bad_step", "not_empty", "out_is_file"])
def test_export_refuses_bad_input_in_one_line_with_nothing_written(reference, tmp_path, capsys, case):
    out = tmp_path / "out"
    run = str(reference)
    extra: list[str] = []
    if case == "not_a_run":
        run = str(tmp_path)
    elif case == "missing":
        run = str(tmp_path / "nothing")
    elif case == "bad_step":
        extra = ["--step", "5"]
    elif case == "not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    else:
        out.write_text("a file")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run_cli(export.main, [run, str(out), *extra]) == 2
    message = capsys.readouterr().err
    assert message.startswith("error: ") and message.count("\n") == 1, message
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "not_empty":
        assert run_cli(export.main, [run, str(out), "--overwrite"]) == 0
        assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
