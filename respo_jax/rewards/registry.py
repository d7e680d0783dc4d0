"""Training rewards by name: `task.reward` picks a function of (prompt record, response text) -> float.

The paper trains on the strict-box verifier (App. D.1), which stays the default (`strict_box`);
`math_verify` scores with verl's Math-Verify call instead (+1 verified, -1 not). A user reward is
registered in the process that trains, e.g. in its `--config` file, as user objectives are:

    from respo_jax.rewards import register_reward
    register_reward("has_box", lambda record, response: 1.0 if "\\\\boxed{" in response else -1.0)
    register_reward("sympy_equal", my_checker, slow=True, timeout_s=5.0)   # defined in a module or file

A reward that says it is slow runs in a pool of fresh worker processes with a hard per-call timeout
(`respo_jax.rewards.scoring`); a worker re-imports the module or re-runs the file that defines the
function (no pickle), so such a function must live at the top level of a module or file that can be
imported or executed again (each worker pays that file's imports: keep them light). Whatever a reward does for one response (raise, return a non-finite or
non-numeric value, time out), that response gets the reward's `failure_score` (default -1.0, "wrong")
and is counted; the run goes on.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import sys
from typing import Callable

from respo_jax.registry import Registry
from respo_jax.rewards.strict_box import strict_box_score

RewardFn = Callable[[dict, str], float]


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A registered reward.

    fn: (prompt record, response text) -> float; the record is the task's prompt dict (`problem`,
      `answer`, ...), the text is the response as the verifier sees it (the prompt format's solution).
    slow: run it in worker processes with `timeout_s` per call (else in the trainer, one after another).
    failure_score: the score of a response whose reward raised, returned a non-finite or non-numeric
      value, or timed out.
    workers: worker processes for a slow reward (default: the CPU count, at most 8).
    source: ("module", "module.name:function") or ("file", path) a worker loads to find `fn` again
      (slow rewards only; a file must register the reward when run, or in its `get_config()`).
    """

    name: str
    fn: RewardFn
    slow: bool = False
    timeout_s: float = 20.0
    failure_score: float = -1.0
    workers: int | None = None
    source: tuple[str, str] | None = None


def strict_box_reward(record: dict, response: str) -> float:
    """The paper's training reward: +1 iff the last strict box equals the record's answer, else -1."""
    return strict_box_score(response, record["answer"])


def math_verify_reward(record: dict, response: str) -> float:
    """verl's Math-Verify score of the response against the record's answer as ±1 (one call; the
    trainer batches it in the Math-Verify process pool)."""
    from respo_jax.rewards.math_verify_pool import math_verify_score

    return 2.0 * math_verify_score(response, record["answer"]) - 1.0


# The rewards by name (`respo_jax.registry.Registry`: built-ins frozen, users add with `register_reward`).
REWARDS: Registry[RewardSpec] = Registry("reward", {
    "strict_box": RewardSpec("strict_box", strict_box_reward),
    "math_verify": RewardSpec("math_verify", math_verify_reward, slow=True),
})
BUILTIN_REWARDS = REWARDS.freeze_builtins()


def reward_names() -> list[str]:
    """Every registered reward name, built-ins first."""
    return REWARDS.names()


def get_reward(name: str) -> RewardSpec:
    """The registered reward `name`; KeyError naming the registered ones."""
    if name not in REWARDS:
        raise KeyError(f"no reward {name!r}; registered: {reward_names()}")
    return REWARDS[name]


def _source_of(fn: Callable) -> tuple[str, str]:
    """Where a worker process finds `fn` again: an importable module, or the file that defines it."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    loaded = sys.modules.get(module) if module else None
    spec = getattr(loaded, "__spec__", None)
    if module != "__main__" and spec is not None and spec.name == module and \
            getattr(loaded, qualname, None) is fn:  # importable, and found there by name
        return ("module", f"{module}:{qualname}")
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        path = None
    if not path or not os.path.isfile(path):
        raise ValueError(f"a slow reward must be defined in a module or a file a worker process can load "
                         f"again; {fn!r} has neither")
    return ("file", os.path.abspath(path))


def register_reward(name: str, fn: RewardFn, *, slow: bool = False, timeout_s: float = 20.0,
                    failure_score: float = -1.0, workers: int | None = None,
                    replace: bool = False) -> RewardSpec:
    """Adds `fn` as the reward `name` (for `task.reward=name`) and returns its spec.

    `name`: a letter, then letters, digits, `_` or `-`; built-in names cannot be replaced, and a taken
    name only with `replace=True`. `slow=True` runs it in worker processes with a hard `timeout_s` per
    response (see the module docstring for where the function must live); `failure_score` (finite) is
    what a failed response scores. ValueError / TypeError name what is wrong.
    """
    REWARDS.check_new(name, replace, callable(fn), "a function of (record, response)", repr(fn))
    if isinstance(failure_score, bool) or not isinstance(failure_score, (int, float)) \
            or not math.isfinite(failure_score):
        raise ValueError(f"reward {name!r}: failure_score must be a finite number; got {failure_score!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"reward {name!r}: timeout_s must be a number > 0; got {timeout_s!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"reward {name!r}: workers must be an int >= 1 or None; got {workers!r}")
    source = _source_of(fn) if slow else None
    spec = RewardSpec(name, fn, bool(slow), float(timeout_s), float(failure_score), workers, source)
    REWARDS[name] = spec
    return spec


def unregister_reward(name: str) -> None:
    """Removes a user reward; built-ins raise ValueError, unknown names KeyError."""
    REWARDS.remove(name)
