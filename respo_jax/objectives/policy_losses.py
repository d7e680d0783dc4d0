"""Policy objectives as pure functions of per-token log-probs: ReSPO (paper §3, App. B), its baselines as
verl runs them (VESPO, GSPO, GRPO) and TRL's objectives (CISPO, SAPO, LUSPO, Dr.GRPO).

Each objective is registered by name with its token-level loss, its hyperparameter defaults and the
aggregation its paper uses:

    objective = get_objective("respo")              # any key of OBJECTIVES; hparams as kwargs
    loss, metrics = objective(logp, old_logp, advantages, mask)
    (total, denominator), metrics = objective.loss_terms(logp, old_logp, advantages, mask)
    terms, metrics, responses = objective.evaluate(logp, old_logp, advantages, mask)   # + per response

``logp, old_logp, mask: [batch, seq]`` float (mask entries 0/1), ``advantages: [batch]``. The loss is a
scalar to minimize. Every objective has the form  token_loss[i, t] = -A_i * r[i, t]  where the
surrogate ``r`` has gradient  d r[i, t] / d logp[i, t] = c[i, t]  (the *gradient coefficient*), so

    d loss / d logp[i, t] = -c[i, t] * A_i * mask[i, t] / D      (token-mean: D = total response tokens)

  ReSPO    c = phi(W_i; A_i), Eq. 12 per sign (stop-gradient), r = phi * log pi (REINFORCE form, Alg. 1);
           log W_i = sum of the raw token log-ratios, clamped to +-20 (the official recipe)
  VESPO    c = W_i^beta exp(lam (1 - W_i)) per sign, same form; each token log-ratio clamped to +-20
           before the sum (VESPO's code)
  GRPO     c = w_it if the PPO clip is inactive else 0, w_it = pi/pi_old per token, clip range
           [1 - eps_low, 1 + eps_high] (eps_high > eps_low: DAPO's "clip-higher"); verl's dual clip:
           for A < 0 and w_it > clip_ratio_c (3) the loss is the constant -clip_ratio_c A, c = 0
  GSPO     c = s_i if the clip is inactive else 0, s_i = exp(mean_t log-ratio), in the token-level form
           s_it = sg(s_i) pi / sg(pi); log s_it clamped above at 10 with c = 0 there (verl);
           seq-mean-token-mean by default (Eq. 2)
  CISPO    c = min(w_it, eps_max), r = sg(c) log pi (MiniMax-M1 / ScaleRL, eps_max = 5)
  SAPO     r = sigmoid(tau (w_it - 1)) 4 / tau, tau per advantage sign (1.0 / 1.05);
           c = 4 s (1 - s) w_it; seq-mean-token-mean
  LUSPO    GSPO's surrogate with seq-mean-token-sum: each sequence's loss scaled by its length
  DR_GRPO  GRPO's surrogate (no dual clip) with seq-mean-token-sum-norm: sum / (responses * L), and
           advantages not divided by the group std (``scale_advantages=False``)

Micro-batch accumulation: divide each micro-batch by the mini-batch denominator,
``objective(..., denominator=objective.denominator(full_mask))``; the summed gradients then equal the
full-batch gradient exactly (see ``aggregation``).

Metrics (scalars, all stop-gradient; the App. E.3 ones are ``positive_branch``'s, as the pooled record's):
  token_count, response_count     response tokens, non-empty responses
  log_w_mean / _min / _max        clamped log W over non-empty responses (0 when there are none)
  positive_low_w_fraction         share of positive (A > 0) responses with log W < -1 (``positive_branch``)
  coef_mean_pos / _neg            mean sequence coefficient (token mean of c) over A > 0 / A < 0 responses
  coef_mass_pos / _neg            sum of coefficient * |A| over A > 0 / A < 0 responses
  positive_low_w_mass_share       share of coef_mass_pos carried by positive responses with log W < -1
  clip_fraction(_low / _high)     GRPO, GSPO, LUSPO, DR_GRPO: share of response tokens whose gradient the
                                  PPO clip removes (CISPO: share of tokens whose weight is truncated)
  clip_fraction_dual              GRPO, DR_GRPO: share of tokens under the dual clip
  clip_fraction_cap               GSPO, LUSPO: share of tokens whose log s_it is capped
Per response (``evaluate``): ``log_w`` (clamped log W) and ``phi`` (the sequence coefficient).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from respo_jax.objectives import kernels
from respo_jax.objectives.aggregation import (
    LossTerms,
    aggregation_terms,
    check_aggregation_mode,
    check_loss_scale_factor,
    loss_denominator,
    safe_divide,
)
from respo_jax.objectives.positive_branch import positive_branch_statistics
from respo_jax.objectives.validation import check_policy_inputs
from respo_jax.registry import Registry

sg = jax.lax.stop_gradient

# verl's clamp on token log-ratios before exponentiating (GRPO, CISPO, SAPO): keeps exp() finite in float32.
TOKEN_LOG_RATIO_CLAMP = 20.0
# verl's compute_policy_loss_gspo clamps log s_it at 10 (numerical stability); the gradient is cut there.
GSPO_LOG_RATIO_CAP = 10.0


class TokenLoss(NamedTuple):
    """What an objective contributes before aggregation."""

    loss: jax.Array  # [batch, seq] per-token loss, differentiable in logp
    coefficient: jax.Array  # [batch, seq] gradient coefficient c (stop-gradient)
    metrics: dict[str, jax.Array]  # objective-specific scalars (e.g. clip fractions)


def _broadcast_rows(row_values: jax.Array, like: jax.Array) -> jax.Array:
    return jnp.broadcast_to(row_values[:, None], like.shape)


def _token_fraction(flags: jax.Array, mask: jax.Array) -> jax.Array:
    return safe_divide(jnp.sum(jnp.where(mask > 0, flags.astype(jnp.float32), 0.0)), jnp.sum(mask))


def respo_token_loss(logp, old_logp, advantages, mask, log_w, *, alpha, beta, lam) -> TokenLoss:
    """ReSPO, Alg. 1: -sg(phi(W_i; A_i)) A_i log pi[i, t] with the two-branch kernel of Eq. 12."""
    phi = sg(kernels.respo_kernel(log_w, advantages, alpha=alpha, beta=beta, lam=lam))
    loss = -(phi * advantages)[:, None] * logp
    return TokenLoss(loss=loss, coefficient=_broadcast_rows(phi, logp), metrics={})


def vespo_token_loss(logp, old_logp, advantages, mask, log_w, *, beta, lam) -> TokenLoss:
    """VESPO: -sg(W^beta e^(lam (1 - W))) A_i log pi[i, t], sign-specific (beta, lam)."""
    phi = sg(kernels.vespo_kernel(log_w, advantages, beta=beta, lam=lam))
    loss = -(phi * advantages)[:, None] * logp
    return TokenLoss(loss=loss, coefficient=_broadcast_rows(phi, logp), metrics={})


def _clip_flags(ratio, advantages_like, eps_low, eps_high):
    """Where min(r A, clip(r) A) takes the clipped (constant) branch: A >= 0 above, A < 0 below the range."""
    high = (advantages_like >= 0) & (ratio > 1.0 + eps_high)
    low = (advantages_like < 0) & (ratio < 1.0 - eps_low)
    return low, high


def _token_ratio(logp, old_logp):
    """(log-ratio clamped to +-20, w = exp of it, where the clamp binds): verl's token ratio, [batch, seq]."""
    raw = logp - old_logp
    log_ratio = jnp.clip(raw, -TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)
    return log_ratio, jnp.exp(log_ratio), sg(jnp.abs(raw) > TOKEN_LOG_RATIO_CLAMP)


def grpo_token_loss(
    logp, old_logp, advantages, mask, log_w, *, eps_low, eps_high, clip_ratio_c
) -> TokenLoss:
    """GRPO/PPO, Eq. 1, as verl's ``compute_policy_loss_vanilla``: -min(w A, clip(w) A) per token with
    w = pi/pi_old, plus the dual clip: for A < 0 and w > clip_ratio_c the loss is the constant
    -clip_ratio_c A (gradient 0); clip_ratio_c=None turns it off."""
    _, ratio, clamped = _token_ratio(logp, old_logp)
    adv = _broadcast_rows(advantages, logp)
    low, high = _clip_flags(sg(ratio), adv, eps_low, eps_high)
    clipped = low | high
    surrogate = jnp.where(clipped, sg(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)), ratio)
    loss = -adv * surrogate
    dual = jnp.zeros_like(clipped)
    if clip_ratio_c is not None:
        dual = (adv < 0) & (sg(ratio) > clip_ratio_c)
        loss = jnp.where(dual, -adv * clip_ratio_c, loss)
    coefficient = sg(jnp.where(clipped | dual | clamped, 0.0, ratio))
    metrics = {
        "clip_fraction": _token_fraction(clipped, mask),
        "clip_fraction_low": _token_fraction(low, mask),
        "clip_fraction_high": _token_fraction(high, mask),
        "clip_fraction_dual": _token_fraction(dual, mask),
    }
    return TokenLoss(loss=loss, coefficient=coefficient, metrics=metrics)


def gspo_token_loss(
    logp, old_logp, advantages, mask, log_w, *, eps_low, eps_high, log_ratio_cap
) -> TokenLoss:
    """GSPO, Eq. 2, as verl's ``compute_policy_loss_gspo``, in token-level form s_it = sg(s_i) pi / sg(pi)
    with s_i = exp(mean_t log-ratio).

    The clip acts on the sequence ratio s_i, so a clipped response loses the gradient of all its tokens;
    log s_it is clamped above at ``log_ratio_cap`` (verl: 10), which cuts the gradient where it binds.
    Under the default seq-mean-token-mean aggregation the gradient is exactly that of Eq. 2.
    """
    lengths = jnp.sum(mask, axis=-1)
    mean_log_ratio = sg(safe_divide(jnp.sum(jnp.where(mask > 0, logp - old_logp, 0.0), axis=-1), lengths))
    capped = mean_log_ratio > log_ratio_cap
    seq_ratio = jnp.exp(jnp.minimum(mean_log_ratio, log_ratio_cap))
    low, high = _clip_flags(seq_ratio, advantages, eps_low, eps_high)
    no_grad = _broadcast_rows(low | high | capped, logp)
    token_ratio = seq_ratio[:, None] * jnp.exp(logp - sg(logp))
    bounded = _broadcast_rows(jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high), logp)
    # Clipped: the constant clip(s); capped (A < 0, s > e^cap): the constant e^cap; else s_it.
    surrogate = jnp.where(
        _broadcast_rows(low | high, logp), bounded, jnp.where(no_grad, sg(token_ratio), token_ratio)
    )
    coefficient = jnp.where(no_grad, 0.0, _broadcast_rows(seq_ratio, logp))
    metrics = {
        "clip_fraction": _token_fraction(_broadcast_rows(low | high, logp), mask),
        "clip_fraction_low": _token_fraction(_broadcast_rows(low, logp), mask),
        "clip_fraction_high": _token_fraction(_broadcast_rows(high, logp), mask),
        "clip_fraction_cap": _token_fraction(_broadcast_rows(capped, logp), mask),
    }
    return TokenLoss(
        loss=-_broadcast_rows(advantages, logp) * surrogate, coefficient=coefficient, metrics=metrics
    )


def cispo_token_loss(logp, old_logp, advantages, mask, log_w, *, eps_max) -> TokenLoss:
    """CISPO (MiniMax-M1; ScaleRL's form, TRL's ``loss_type="cispo"``): -sg(min(w, eps_max)) A log pi.

    The importance weight itself is truncated and detached, so no token loses its gradient; w = pi/pi_old
    with verl's +-20 clamp of the token log-ratio.
    """
    _, ratio, _ = _token_ratio(logp, old_logp)
    weight = sg(jnp.minimum(ratio, eps_max))
    adv = _broadcast_rows(advantages, logp)
    metrics = {"clip_fraction": _token_fraction(sg(ratio) > eps_max, mask)}
    return TokenLoss(loss=-(weight * adv) * logp, coefficient=weight, metrics=metrics)


def sapo_token_loss(logp, old_logp, advantages, mask, log_w, *, tau_pos, tau_neg) -> TokenLoss:
    """SAPO (soft adaptive policy optimization): -f(w) A per token with the soft gate
    f(w) = sigmoid(tau (w - 1)) 4 / tau, tau = tau_pos for A > 0 and tau_neg otherwise (verl, TRL).

    The gradient coefficient is f'(w) w = 4 s (1 - s) w, s = sigmoid(tau (w - 1)): 1 on-policy, decaying
    smoothly on both sides instead of dropping to 0 at a clip boundary.
    """
    _, ratio, clamped = _token_ratio(logp, old_logp)
    adv = _broadcast_rows(advantages, logp)
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    s = jax.nn.sigmoid(tau * (sg(ratio) - 1.0))
    coefficient = jnp.where(clamped, 0.0, 4.0 * s * (1.0 - s) * sg(ratio))
    return TokenLoss(loss=-gate * adv, coefficient=coefficient, metrics={})


def sequence_coefficient(coefficient, mask) -> jax.Array:
    """The sequence coefficient: token mean of c over each response, [batch] (0 for empty responses).

    For ReSPO and VESPO it is phi(W_i); for the token-level objectives the mean gradient weight."""
    lengths = jnp.sum(mask, axis=-1)
    return safe_divide(jnp.sum(jnp.where(mask > 0, coefficient, 0.0), axis=-1), lengths)


def sequence_metrics(log_w, advantages, mask, seq_coef) -> dict[str, jax.Array]:
    """Diagnostics shared by every objective (paper App. E.3); see the module docstring for the keys.

    ``seq_coef: [batch]`` is ``sequence_coefficient`` of the objective's gradient coefficient."""
    lengths = jnp.sum(mask, axis=-1)
    non_empty = lengths > 0
    response_count = jnp.sum(non_empty.astype(jnp.float32))
    seq_mass = seq_coef * jnp.abs(advantages)
    positive = non_empty & (advantages > 0)
    negative = non_empty & (advantages < 0)
    e3 = positive_branch_statistics(log_w, advantages, seq_coef, lengths)

    def masked_sum(values, where):
        return jnp.sum(jnp.where(where, values, 0.0))

    def count(where):
        return jnp.sum(where.astype(jnp.float32))

    has_any = response_count > 0
    mass_pos = masked_sum(seq_mass, positive)
    return {
        "token_count": jnp.sum(mask),
        "response_count": response_count,
        "log_w_mean": safe_divide(masked_sum(log_w, non_empty), response_count),
        "log_w_min": jnp.where(has_any, jnp.min(jnp.where(non_empty, log_w, jnp.inf)), 0.0),
        "log_w_max": jnp.where(has_any, jnp.max(jnp.where(non_empty, log_w, -jnp.inf)), 0.0),
        "positive_low_w_fraction": e3["positive_low_w_share"],
        "coef_mean_pos": safe_divide(masked_sum(seq_coef, positive), count(positive)),
        "coef_mean_neg": safe_divide(masked_sum(seq_coef, negative), count(negative)),
        "coef_mass_pos": mass_pos,
        "coef_mass_neg": masked_sum(seq_mass, negative),
        "positive_low_w_mass_share": e3["positive_low_w_mass_share"],
    }


# ----------------------------------------------------------------------------- hyperparameters


def _real(objective: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{objective}: {name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{objective}: {name} must be finite, got {value}")
    return value


def _positive(objective: str, name: str, value) -> float:
    value = _real(objective, name, value)
    if not value > 0.0:
        raise ValueError(f"{objective}: {name} must be > 0, got {value}")
    return value


def _pair(objective: str, name: str, value) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(
            f"{objective}: {name} must be a (positive-branch, negative-branch) pair, got {value!r}"
        )
    return (_real(objective, f"{name}[0]", value[0]), _real(objective, f"{name}[1]", value[1]))


def checker_for_reshaping_family(objective: str) -> Callable[[dict], dict]:
    """The check of a two-branch (alpha, beta, lam) objective of Eq. 12 (ReSPO and user members of the
    family, ``respo_jax.objectives.registry.reshaping_objective``): each hyperparameter a (A >= 0, A < 0)
    pair, each branch inside the family."""

    def check(h: dict) -> dict:
        out = {key: _pair(objective, key, h[key]) for key in ("alpha", "beta", "lam")}
        for branch, side in enumerate(("positive", "negative")):
            alpha, beta, lam = out["alpha"][branch], out["beta"][branch], out["lam"][branch]
            try:
                kernels.check_kernel_params(alpha, beta, lam)
            except ValueError as err:
                raise ValueError(f"{objective}, {side} branch: {err}") from None
        return out

    return check


def _check_vespo(h: dict) -> dict:
    out = {key: _pair("vespo", key, h[key]) for key in ("beta", "lam")}
    for branch, side in enumerate(("positive", "negative")):
        if out["beta"][branch] < 0:
            raise ValueError(
                f"vespo, {side} branch: beta must be >= 0 (phi -> inf as W -> 0 otherwise), "
                f"got {out['beta'][branch]}"
            )
        if out["lam"][branch] < 0:
            raise ValueError(f"vespo, {side} branch: lam must be >= 0, got {out['lam'][branch]}")
    return out


def _check_clip_range(objective: str, h: dict) -> dict:
    eps_low = _real(objective, "eps_low", h["eps_low"])
    eps_high = _real(objective, "eps_high", h["eps_high"])
    if not 0.0 < eps_low < 1.0:
        raise ValueError(f"{objective}: eps_low must lie in (0, 1), got {eps_low}")
    if not eps_high > 0.0:
        raise ValueError(f"{objective}: eps_high must be > 0, got {eps_high}")
    return {"eps_low": eps_low, "eps_high": eps_high}


def _checker_for_grpo(objective: str) -> Callable[[dict], dict]:
    def check(h: dict) -> dict:
        out = _check_clip_range(objective, h)
        c = h["clip_ratio_c"]
        if c is not None:
            c = _real(objective, "clip_ratio_c", c)
            if not c > 1.0:
                raise ValueError(
                    f"{objective}: clip_ratio_c must be > 1 (the dual clip's lower bound), or None; got {c}"
                )
        return {**out, "clip_ratio_c": c}

    return check


def _checker_for_gspo(objective: str) -> Callable[[dict], dict]:
    def check(h: dict) -> dict:
        return {**_check_clip_range(objective, h), "log_ratio_cap": _positive(objective, "log_ratio_cap",
                                                                              h["log_ratio_cap"])}

    return check


def _check_cispo(h: dict) -> dict:
    return {"eps_max": _positive("cispo", "eps_max", h["eps_max"])}


def _check_sapo(h: dict) -> dict:
    return {key: _positive("sapo", key, h[key]) for key in ("tau_pos", "tau_neg")}


# The keys every objective accepts besides its own hyperparameters.
COMMON_KEYS = ("aggregation", "loss_scale_factor", "scale_advantages")


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """A registered objective: its token-level loss, hyperparameter defaults and their check, plus the
    settings its paper (or the reference code) pairs it with: aggregation mode, the clamp of each token's
    log-ratio inside log W (None: the raw sum), and whether advantages are divided by the group std.

    ``token_loss(logp, old_logp, advantages, mask, log_w, **hparams) -> TokenLoss`` (arrays as in the
    module docstring, ``log_w: [batch]`` the clamped sequence log-weight, stop-gradient);
    ``check(hparams) -> hparams`` validates a full hyperparameter dict and returns it normalized to
    hashable values (a configured objective is a static argument of ``jax.jit``). New objectives are
    added with ``respo_jax.objectives.register_objective``; the fields are checked on construction.
    """

    token_loss: Callable[..., TokenLoss]
    defaults: Mapping[str, Any]
    check: Callable[[dict], dict]
    aggregation: str = "token-mean"
    token_log_ratio_clamp: float | None = None
    scale_advantages: bool = True

    def __post_init__(self):
        if not callable(self.token_loss):
            raise TypeError(f"ObjectiveSpec.token_loss must be callable; got {self.token_loss!r}")
        if not callable(self.check):
            raise TypeError(f"ObjectiveSpec.check must be callable; got {self.check!r}")
        if not isinstance(self.defaults, Mapping) or not all(isinstance(k, str) for k in self.defaults):
            raise TypeError(
                f"ObjectiveSpec.defaults must map hyperparameter names to values; got {self.defaults!r}"
            )
        shadowed = sorted(set(self.defaults) & set(COMMON_KEYS))
        if shadowed:
            raise ValueError(f"ObjectiveSpec.defaults may not define the common keys {shadowed}")
        check_aggregation_mode(self.aggregation)
        clamp = self.token_log_ratio_clamp
        if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float))
                                  or not math.isfinite(clamp) or clamp <= 0):
            raise ValueError(
                f"ObjectiveSpec.token_log_ratio_clamp must be None or a number > 0; got {clamp!r}"
            )
        if not isinstance(self.scale_advantages, bool):
            raise TypeError(f"ObjectiveSpec.scale_advantages must be a bool; got {self.scale_advantages!r}")


# The objectives by name (`respo_jax.registry.Registry`: built-ins frozen, users add with
# `respo_jax.objectives.register_objective`).
OBJECTIVES: Registry[ObjectiveSpec] = Registry("objective", {
    "respo": ObjectiveSpec(
        respo_token_loss,
        {"alpha": kernels.RESPO_ALPHA, "beta": kernels.RESPO_BETA, "lam": kernels.RESPO_LAMBDA},
        checker_for_reshaping_family("respo"),
    ),
    "vespo": ObjectiveSpec(
        vespo_token_loss,
        {"beta": kernels.VESPO_BETA, "lam": kernels.VESPO_LAMBDA},
        _check_vespo,
        token_log_ratio_clamp=TOKEN_LOG_RATIO_CLAMP,  # VESPO's code clamps each token's log-ratio to +-20
    ),
    "grpo": ObjectiveSpec(
        grpo_token_loss,
        {"eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": 3.0},  # verl's dual-clip default
        _checker_for_grpo("grpo"),
    ),
    "gspo": ObjectiveSpec(
        gspo_token_loss,
        {"eps_low": 3e-4, "eps_high": 4e-4, "log_ratio_cap": GSPO_LOG_RATIO_CAP},
        _checker_for_gspo("gspo"),
        aggregation="seq-mean-token-mean",  # Eq. 2; verl's GSPO loss always aggregates this way
    ),
    "cispo": ObjectiveSpec(cispo_token_loss, {"eps_max": 5.0}, _check_cispo),  # ScaleRL; TRL's epsilon_high
    "sapo": ObjectiveSpec(
        sapo_token_loss, {"tau_pos": 1.0, "tau_neg": 1.05}, _check_sapo, aggregation="seq-mean-token-mean"
    ),
    "luspo": ObjectiveSpec(  # GSPO with each sequence's loss scaled by its length (LUSPO §5.1 clip range)
        gspo_token_loss,
        {"eps_low": 2e-3, "eps_high": 2.5e-3, "log_ratio_cap": GSPO_LOG_RATIO_CAP},
        _checker_for_gspo("luspo"),
        aggregation="seq-mean-token-sum",
    ),
    "dr_grpo": ObjectiveSpec(  # Dr.GRPO: no length normalization, no std normalization
        grpo_token_loss,
        {"eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": None},
        _checker_for_grpo("dr_grpo"),
        aggregation="seq-mean-token-sum-norm",
        scale_advantages=False,
    ),
})


class ObjectiveOutput(NamedTuple):
    """Everything one evaluation of an objective produces."""

    terms: LossTerms  # the loss before division, additive over micro-batches
    metrics: dict[str, jax.Array]  # scalars (module docstring)
    responses: dict[str, jax.Array]  # per response, [batch]: "log_w" (clamped log W) and "phi"


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """A configured objective; hashable, so it can be a static argument of ``jax.jit``."""

    name: str
    hparams: tuple[tuple[str, Any], ...]
    aggregation: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's L (None: the padded width)
    scale_advantages: bool = True  # divide group-centred rewards by their std (False: Dr.GRPO)

    @property
    def config(self) -> dict[str, Any]:
        """Hyperparameters including the common keys, as passed to ``get_objective``."""
        return {
            **dict(self.hparams),
            "aggregation": self.aggregation,
            "loss_scale_factor": self.loss_scale_factor,
            "scale_advantages": self.scale_advantages,
        }

    def for_budget(self, max_new_tokens: int) -> "PolicyObjective":
        """This objective for responses of at most ``max_new_tokens`` tokens: seq-mean-token-sum-norm's
        constant L, when not given, is that generation budget (Dr.GRPO's constant), not a batch's
        padded width; every other objective is returned unchanged."""
        if self.aggregation == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            return dataclasses.replace(self, loss_scale_factor=float(max_new_tokens))
        return self

    def denominator(self, mask) -> jax.Array:
        """Aggregation denominator of ``mask: [batch, seq]``; pass the mini-batch's to each micro-batch."""
        return loss_denominator(mask, self.aggregation, self.loss_scale_factor)

    def evaluate(self, logp, old_logp, advantages, mask, token_weight=None) -> ObjectiveOutput:
        """Loss terms, scalar metrics and per-response diagnostics of one batch (all stop-gradient but the
        loss); ``logp, old_logp, mask: [batch, seq]``, ``advantages: [batch]``. ``token_weight: [batch,
        seq]`` (stop-gradient; e.g. ``rollout_correction_weights``) multiplies each token's loss term
        before aggregation, the denominator unchanged; the metrics and diagnostics do not see it."""
        check_policy_inputs(logp, old_logp, advantages, mask)
        spec = OBJECTIVES[self.name]
        mask = jnp.asarray(mask, jnp.float32)
        valid = mask > 0
        # Padding may hold anything (even inf); zero it so neither value nor gradient can see it.
        logp = jnp.where(valid, jnp.asarray(logp).astype(jnp.float32), 0.0)
        old_logp = sg(jnp.where(valid, jnp.asarray(old_logp).astype(jnp.float32), 0.0))
        advantages = sg(jnp.asarray(advantages).astype(jnp.float32))
        log_w = sg(kernels.sequence_log_ratio(logp, old_logp, mask, token_clamp=spec.token_log_ratio_clamp))
        token = spec.token_loss(logp, old_logp, advantages, mask, log_w, **dict(self.hparams))
        token_loss = token.loss
        if token_weight is not None:
            token_loss = token_loss * sg(jnp.where(valid, jnp.asarray(token_weight, jnp.float32), 0.0))
        terms = aggregation_terms(token_loss, mask, self.aggregation, self.loss_scale_factor)
        seq_coef = sequence_coefficient(sg(token.coefficient), mask)
        metrics = sequence_metrics(log_w, advantages, mask, seq_coef)
        metrics.update(token.metrics)
        metrics = {key: sg(value) for key, value in metrics.items()}
        return ObjectiveOutput(terms, metrics, {"log_w": log_w, "phi": sg(seq_coef)})

    def loss_terms(self, logp, old_logp, advantages, mask) -> tuple[LossTerms, dict[str, jax.Array]]:
        """(LossTerms(total, denominator), metrics): the loss before division, additive over micro-batches."""
        out = self.evaluate(logp, old_logp, advantages, mask)
        return out.terms, out.metrics

    def __call__(
        self, logp, old_logp, advantages, mask, denominator=None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, metrics); ``denominator``: the mini-batch's, when this call is one micro-batch."""
        terms, metrics = self.loss_terms(logp, old_logp, advantages, mask)
        return terms.loss(denominator), metrics


def get_objective(name: str, **hparams) -> PolicyObjective:
    """The objective ``name`` (a key of ``OBJECTIVES``) with ``hparams`` overriding its defaults.

    Every objective also takes the common keys: ``aggregation`` (one of ``AGGREGATION_MODES``; default:
    the objective's own), ``loss_scale_factor`` (seq-mean-token-sum-norm's constant; default None) and
    ``scale_advantages`` (default: the objective's own). Unknown names raise KeyError; unknown or
    invalid hyperparameters raise ValueError.
    """
    if name not in OBJECTIVES:
        raise KeyError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}")
    spec = OBJECTIVES[name]
    aggregation = check_aggregation_mode(hparams.pop("aggregation", spec.aggregation))
    loss_scale_factor = check_loss_scale_factor(hparams.pop("loss_scale_factor", None))
    scale_advantages = hparams.pop("scale_advantages", spec.scale_advantages)
    if not isinstance(scale_advantages, bool):
        raise ValueError(f"{name}: scale_advantages must be true or false; got {scale_advantages!r}")
    unknown = sorted(set(hparams) - set(spec.defaults))
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {unknown} for objective {name!r}; "
            f"expected some of {sorted(spec.defaults) + list(COMMON_KEYS)}"
        )
    values = spec.check({**spec.defaults, **hparams})
    return PolicyObjective(
        name=name,
        hparams=tuple(sorted(values.items())),
        aggregation=aggregation,
        loss_scale_factor=loss_scale_factor,
        scale_advantages=scale_advantages,
    )


respo_objective = get_objective("respo")
vespo_objective = get_objective("vespo")
gspo_objective = get_objective("gspo")
grpo_objective = get_objective("grpo")
