"""Training rewards by name: the registry, failure containment in the trainer's process and in
the worker pool of a slow reward (a raising, NaN, non-numeric and hanging reward each scored
`failure_score` and counted), and start-up errors for an unknown `task.reward`."""

from __future__ import annotations

import functools
import math
import pathlib
import textwrap

import numpy as np
import pytest

from experiments.train import DEFAULT_CONFIG, cli, load_config
from respo_jax.rewards import (
    FAILED,
    SCORED,
    TIMED_OUT,
    RewardScorer,
    get_reward,
    register_reward,
    reward_names,
    strict_box_score,
    unregister_reward,
)
from respo_jax.training.config import ConfigError, apply_overrides

RECORDS = [{"problem": "1+1=", "answer": "2"}, {"problem": "2+2=", "answer": "4"}]


@pytest.fixture
def registered():
    """Names this test registers, removed afterwards (the registry is per process)."""
    names: list[str] = []
    yield names
    for name in names:
        unregister_reward(name)


def test_strict_box_is_the_default_and_scores_as_the_verifier():
    spec = get_reward(load_config(DEFAULT_CONFIG).task.reward)
    responses = ["so \\boxed{2}", "\\boxed{ 4}", "no box", "\\boxed{4}"]
    records = [RECORDS[0], RECORDS[1], RECORDS[0], RECORDS[1]]
    scores, status = RewardScorer(spec)(records, responses)
    assert spec.name == "strict_box" and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, [strict_box_score(r, rec["answer"])
                                           for r, rec in zip(responses, records)])
    np.testing.assert_array_equal(scores, [1.0, -1.0, -1.0, 1.0])
    np.testing.assert_array_equal(status, [SCORED] * 4)
    assert {"strict_box", "math_verify"} <= set(reward_names())


def test_math_verify_reward_is_verls_call_as_plus_minus_one():
    scorer = RewardScorer(get_reward("math_verify"))
    try:
        records = [{"answer": "\\frac{1}{2}"}, {"answer": "\\frac{1}{2}"}, {"answer": "3"}]
        scores, status = scorer(records, ["so \\boxed{0.5}", "\\boxed{2}", "the answer is 3"])
    finally:
        scorer.close()
    np.testing.assert_array_equal(scores, np.float32([1.0, -1.0, 1.0]))
    np.testing.assert_array_equal(status, [SCORED] * 3)


def test_registration_checks_names_and_options(registered):
    with pytest.raises(ValueError, match="built in"):
        register_reward("strict_box", lambda record, response: 1.0)
    with pytest.raises(ValueError, match="start with a letter"):
        register_reward("1bad", lambda record, response: 1.0)
    with pytest.raises(TypeError, match="needs a function"):
        register_reward("not_callable", 3.0)
    with pytest.raises(ValueError, match="failure_score must be a finite number"):
        register_reward("nan_failure", lambda record, response: 1.0, failure_score=math.nan)
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        register_reward("no_time", lambda record, response: 1.0, timeout_s=0)
    with pytest.raises(ValueError, match="a module or a file"):
        register_reward("slow_partial", functools.partial(_flaky), slow=True)  # no module name, no file
    register_reward("once", lambda record, response: 1.0)
    registered.append("once")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("once", lambda record, response: 0.0)
    assert get_reward("once").fn({}, "") == 1.0
    with pytest.raises(KeyError, match="no reward 'nope'"):
        get_reward("nope")


def _flaky(record: dict, response: str):
    if response == "raise":
        raise RuntimeError("the reward failed")
    if response == "nan":
        return math.nan
    if response == "inf":
        return -math.inf
    if response == "text":
        return "1.0"
    return float(len(response))


def test_failures_of_a_fast_reward_score_failure_score_and_are_counted(registered):
    spec = register_reward("flaky", _flaky, failure_score=-0.5)
    registered.append("flaky")
    responses = ["abc", "raise", "nan", "inf", "text", "ab"]
    scores, status = RewardScorer(spec)([RECORDS[0]] * len(responses), responses)
    np.testing.assert_array_equal(scores, np.float32([3.0, -0.5, -0.5, -0.5, -0.5, 2.0]))
    np.testing.assert_array_equal(status, [SCORED, FAILED, FAILED, FAILED, FAILED, SCORED])


SLOW_REWARD = '''
import math
import time

from experiments.configs.respo_synthetic import get_config as base_config
from respo_jax.rewards import register_reward


def hangs_sometimes(record, response):
    if response == "hang":
        time.sleep(60)
    if response == "raise":
        raise ValueError("cannot score " + response)
    if response == "nan":
        return math.nan
    return 1.0 if response == record["answer"] else -1.0


register_reward("hangs_sometimes", hangs_sometimes, slow=True, timeout_s=2.0, failure_score=-2.0, workers=2)


def get_config():
    import dataclasses

    config = base_config()
    return dataclasses.replace(config, task=dataclasses.replace(config.task, reward="hangs_sometimes"))
'''


def test_a_slow_reward_from_a_config_file_runs_in_workers_with_a_timeout(tmp_path, registered):
    """The --config file registers a slow reward; its workers re-run the file to find it, a hanging call is
    killed at timeout_s, and raising / NaN calls are failures; the batch completes in order."""
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_REWARD)
    config = load_config(str(path))
    registered.append("hangs_sometimes")
    spec = get_reward(config.task.reward)
    assert spec.slow and spec.source == ("file", str(path))
    scorer = RewardScorer(spec)
    try:
        responses = ["2", "hang", "raise", "3", "nan", "4"]
        records = [RECORDS[0], RECORDS[0], RECORDS[1], RECORDS[0], RECORDS[1], RECORDS[1]]
        scores, status = scorer(records, responses)
        np.testing.assert_array_equal(scores, np.float32([1.0, -2.0, -2.0, -1.0, -2.0, 1.0]))
        np.testing.assert_array_equal(status, [SCORED, TIMED_OUT, FAILED, SCORED, FAILED, SCORED])
        assert scorer.stats.workers_killed == 1
        scores, status = scorer(RECORDS, ["2", "5"])  # the replaced worker serves the next batch
        np.testing.assert_array_equal(scores, np.float32([1.0, -1.0]))
    finally:
        scorer.close()


def test_an_unknown_reward_is_a_one_line_start_up_error(tmp_path, capsys):
    config = load_config(DEFAULT_CONFIG)
    with pytest.raises(ConfigError, match=r"task.reward='strict_boxx': expected a registered reward, one of "
                                          r"\['math_verify', 'strict_box'"):
        apply_overrides(config, ["task.reward=strict_boxx"]).check_paths()
    out = tmp_path / "run"
    assert cli(["task.reward=nope", f"run.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "task.reward='nope'" in err
    assert not out.exists()


USER_REWARD = '''
import dataclasses
import math
import zlib

from experiments.configs.respo_synthetic import get_config as base_config
from respo_jax.rewards import register_reward, strict_box_score


def crc_flaky_box(record, response):
    """The strict box, except that a third of the responses raise and a third give NaN."""
    kind = zlib.crc32(response.encode()) % 3
    if kind == 0:
        raise ValueError("a reward that raises")
    if kind == 1:
        return math.nan
    return strict_box_score(response, record["answer"])


register_reward("crc_flaky_box", crc_flaky_box)


def get_config():
    config = base_config()
    return dataclasses.replace(config, task=dataclasses.replace(config.task, reward="crc_flaky_box"))
'''


def write_user_reward_config(folder: pathlib.Path) -> pathlib.Path:
    """A --config file registering `crc_flaky_box` (used by tests/test_tracking.py's training run)."""
    path = folder / "user_reward.py"
    path.write_text(textwrap.dedent(USER_REWARD))
    return path


def test_objectives_and_rewards_share_one_registry_with_its_rules():
    from respo_jax.objectives import OBJECTIVES
    from respo_jax.registry import Registry
    from respo_jax.rewards.registry import REWARDS

    assert isinstance(OBJECTIVES, Registry) and isinstance(REWARDS, Registry)
    things = Registry("thing", {"a": 1})
    assert things.freeze_builtins() == {"a"}
    things.check_name("b-2_x")
    with pytest.raises(ValueError, match=r"^thing name must start with a letter .*; got '2b'$"):
        things.check_name("2b")
    with pytest.raises(ValueError, match="^thing 'a' is built in and cannot be replaced"):
        things.check_free("a", replace=True)
    things["b"] = 2
    with pytest.raises(ValueError, match="^thing 'b' is already registered; pass replace=True"):
        things.check_free("b", replace=False)
    things.check_free("b", replace=True)
    assert things.names() == ["a", "b"] and things.user_names() == ["b"]
    with pytest.raises(ValueError, match="^thing 'a' is built in and cannot be removed$"):
        things.remove("a")
    things.remove("b")
    with pytest.raises(KeyError, match=r"no registered thing 'b'; user things are \[\]"):
        things.remove("b")
    assert dict(things) == {"a": 1}
