"""Gradient starvation at CPU scale, third study: the pilot that must pass before the grid runs.

The question: where responses are long and per-token drift small, does ReSPO's positive kernel phi+ help
through the low-W positive tail, as the paper's mechanism says? The task mixes lengths
(`scratchpad_mixed`: 2-16 one-digit operands, correct responses up to ~160 tokens; `max_new_tokens` 193,
the task's bound on a correct response with EOS, which the trainer requires), so the
long problems (12-16 operands) give positives that are rare, long and carry large |A|.

Arms (the grid, after the pilot): VESPO, ReSPO, GRPO, `respo_vespo` (ReSPO's phi+ with VESPO's phi-) and
`respo_vespo_tailcut` (the same with phi+ replaced by VESPO's phi+ only where A > 0 and log W < -1:
the causal ablation of the tail), registered here with `kernel_objective`; an N = 1 control. Primary
contrasts: respo_vespo vs VESPO, and respo_vespo vs its tail-cut twin, with paired cluster-bootstrap
intervals over problems x seeds (`respo_jax.eval.statistics.paired_cluster_bootstrap`).

PRE-REGISTERED ACCEPTANCE RULE (decided on the pilot, before any report seed runs). A pilot setting
(step size, N) is accepted when, on the pilot seed, both hold for GRPO:
  1. its mean clip fraction over the run is < 1% (PILOT_CLIP_LIMIT: its token clip rarely binds), and
  2. >= 15% (PILOT_TAIL_SHARE) of its positive responses (A > 0) to long problems (LONG_OPERANDS: 12-16
     operands) have log W < -1 inside App. E.3's window (the first half of the run's rollout batches).
`pilot_accepted` is the rule as code; condition 2's share is
`experiments.starvation_problems.long_positive_tail_share(run)` of GRPO's cell. If no setting passes after
the levers (warm-up length, operand range, N, step size) are tried, the study reports what was tried and
stops there. `--pilot-report` applies the rule to the finished GRPO cells (decision.json and decision.md in
sweep.out_dir, with the base model's accuracy by operand count); a lever changed is a new pilot setting
(PILOT_SETTINGS), recorded in the pilot's README. Outcome: no setting passed (settings 1-6, every lever
tried; the pilot README's decision), so the grid has not run.

`get_config()` is the pilot's current setting (PILOT_SETTINGS[PILOT_SETTING]): GRPO at N in {32, 128}
(setting 5: 256), lr 2.5e-5 (setting 6: 5e-5), the pilot seed 5 (the report seeds will be 0-4). Each
setting tried keeps its own decision directory; `pilot_setting(k)` rebuilds setting k.
`get_quick_config()` is a smoke run of a few iterations.
"""

import dataclasses

import jax.numpy as jnp

from experiments.configs import gradient_starvation_v2 as v2
from respo_jax.objectives import kernel_objective, register_objective
from respo_jax.objectives.kernels import vespo_kernel
from respo_jax.training.config import apply_overrides, derive
from respo_jax.training.sweep import StarvationConfig, SweepConfig

PILOT_CLIP_LIMIT, PILOT_TAIL_SHARE, TAIL_LOG_W = 0.01, 0.15, -1.0
LONG_OPERANDS = (12, 16)  # the long problems: this many operands, bounds included
# the primary contrasts (A, B) of the grid's paired endpoints (`experiments.starvation_v3`)
PRIMARY_CONTRASTS = (("respo_vespo", "vespo"), ("respo_vespo", "respo_vespo_tailcut"))


respo_vespo_phi = v2.respo_pos_vespo_neg_phi  # ReSPO's phi+ for A >= 0, VESPO's phi- for A < 0


def respo_vespo_tailcut_phi(log_w, advantages):
    """`respo_vespo_phi` with VESPO's phi+ = W^2 e^(3 (1 - W)) where A > 0 and log W < -1: ReSPO's
    positive kernel everywhere except on the low-W positive tail, which it is meant to rescue."""
    one = jnp.ones_like(log_w)
    tail = (advantages > 0) & (log_w < TAIL_LOG_W)
    return jnp.where(tail, vespo_kernel(log_w, one), respo_vespo_phi(log_w, advantages))


ARMS = {"respo_vespo": respo_vespo_phi, "respo_vespo_tailcut": respo_vespo_tailcut_phi}


def register_arms() -> None:
    """Registers the arms (token-mean, as ReSPO; again on a reload of this file: replace=True)."""
    for name, kernel in ARMS.items():
        register_objective(name, kernel_objective(kernel), replace=True)


def pilot_accepted(clip_fraction: float | None, long_positive_tail_share: float | None) -> bool:
    """The pre-registered rule on GRPO's pilot cell: clip fraction < 1% and >= 15% of long-problem
    positives with log W < -1 in the E.3 window (None: not measured, so not accepted)."""
    return (clip_fraction is not None and long_positive_tail_share is not None
            and clip_fraction < PILOT_CLIP_LIMIT and long_positive_tail_share >= PILOT_TAIL_SHARE)


PILOT_DIR = "experiments/results/gradient_starvation_v3/pilot"


def _setting(warmup_steps: int, max_operands: int, reuse: str, lr: str, runs: str,
             out: str) -> tuple[str, ...]:
    """One pilot setting's complete overrides; `runs` and `out` are relative to PILOT_DIR."""
    return (f"warmup.steps={warmup_steps}", f"warmup.max_operands={max_operands}", f"sweep.reuse={reuse}",
            f"optim.learning_rate={lr}", f"sweep.runs_dir={PILOT_DIR}/{runs}".rstrip("/"),
            f"sweep.out_dir={PILOT_DIR}/{out}".rstrip("/"))


# The pilot settings tried, in order, as overrides of `pilot_setting`'s common config, each complete (so
# `--pilot-report` with setting k's overrides reports setting k whichever is current; the pilot's README
# records each one's outcome):
#   1. a warm-up of 2,000 steps, so that the loss on the long problems plateaus;
#   2. a warm-up of 1,000 steps: the end of the slow phase of setting 1's loss curve, before its steep
#      drop over steps 1,000-1,200;
#   3. a warm-up of 1,100 steps: the middle of that drop (at 1,000 steps the long problems were at the
#      target but the short ones were not yet learned);
#   4. the operand range: a warm-up of 2,000 steps on 2-11-operand problems only, while RL and the
#      held-out problems keep 2-16, so a correct long answer rests on length generalization. The warm-up
#      length moved short and long accuracy together (settings 1-3); 2,000 steps is setting 1's, whose
#      loss was flat from step ~1,500 on with the short problems mostly solved; the short-only stream
#      gives them 1.5x setting 1's examples, and ~0.7M partial-sum steps in all, past the ~0.6M by the
#      end of setting 1's drop (step 1,200).
#   5. N: setting 4's base model and step size at N = 256 (its cells share setting 4's runs directory, so
#      its base model): from N = 32 to 128 the long-positive tail share grew 7x (1.0% -> 7.2%) and the
#      clip fraction 2.6x (0.29% -> 0.76%), so a larger N is the lever that moves the tail faster than
#      the clip; 256 divides the 1,024 updates (4 rollout batches, the E.3 window the first 2).
#   6. the step size: setting 4's base model at N = 128 and twice its lr (5e-5), since from N = 128 to 256
#      the tail share stayed at 7-8% (7.2% -> 7.9%) while the clip fraction rose (0.76% -> 0.88%); the
#      base model is setting 4's, copied (the same fingerprint: the RL settings are not part of it).
PILOT_SETTINGS = {
    1: _setting(2000, 0, "32,128", "2.5e-5", "runs", ""),
    2: _setting(1000, 0, "32,128", "2.5e-5", "setting2/runs", "setting2"),
    3: _setting(1100, 0, "32,128", "2.5e-5", "setting3/runs", "setting3"),
    4: _setting(2000, 11, "32,128", "2.5e-5", "setting4/runs", "setting4"),
    5: _setting(2000, 11, "256", "2.5e-5", "setting4/runs", "setting5"),
    6: _setting(2000, 11, "128", "5e-5", "setting6/runs", "setting6"),
}
PILOT_SETTING = 6  # the setting `get_config()` runs


def pilot_setting(setting: int) -> StarvationConfig:
    """Pilot setting `setting` (a key of PILOT_SETTINGS): the second study's model, optimizer and held-out
    evaluation, with this study's task and pilot sweep, and that setting's warm-up and directories."""
    register_arms()
    common = dataclasses.replace(
        derive(
            v2.get_config(),
            task={"difficulty": "scratchpad_mixed"},
            rollout={"max_new_tokens": 193, "prompt_bucket": 256},  # the package default: no cells to match
            optim={"learning_rate": 2.5e-5},
        ),
        # a sweep of its own (the pilot), not the second study's grid
        sweep=SweepConfig(objectives="grpo", reuse="32,128", seeds="5", policy_updates=1024),
    )
    return apply_overrides(common, list(PILOT_SETTINGS[setting]))


def get_config() -> StarvationConfig:
    """The pilot's current setting, PILOT_SETTING."""
    return pilot_setting(PILOT_SETTING)


def get_quick_config() -> StarvationConfig:
    """A smoke run: the pilot's task with GRPO and the tail-cut arm at N = 2, a few updates."""
    return derive(
        get_config(),
        rollout={"prompts_per_minibatch": 2, "group_size": 4},
        warmup={"steps": 4, "batch_size": 8},
        run={"eval_problems": 8, "eval_samples": 2},
        sweep={"objectives": "grpo,respo_vespo_tailcut", "reuse": "2", "seeds": "0", "policy_updates": 2,
               "runs_dir": "runs/gradient_starvation_v3_quick",
               "out_dir": "runs/gradient_starvation_v3_quick/results"},
    )
