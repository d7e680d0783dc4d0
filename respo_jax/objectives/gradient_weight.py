"""The effective per-response gradient weight of any registered objective (paper Fig. 1), measured by
differentiating the objective itself, so a plot shows what training does rather than a re-typed formula.

Take one response of T tokens whose token log-ratios all equal log W / T, alone in its batch. Every
objective's gradient then has the form

    grad_theta loss = -omega(W; A) * A * mean_t grad_theta log pi_t,   omega = -(sum_t d loss / d logp_t) / A

omega is the weight the objective puts on the on-policy policy gradient of that response (1 at W = 1
for every built-in objective): phi(W) for ReSPO and VESPO; W inside the clip range and 0 where the clip
binds for GRPO (per token, T = 1) and GSPO (on s = W^(1/T), so its trust region in W widens with T);
min(W, eps_max) for CISPO. Aggregations that do not divide by the length scale it: seq-mean-token-sum
(LUSPO) gives T times the coefficient, seq-mean-token-sum-norm T / L times.

  response_gradient_weight   omega for arrays of log W and advantages
  plot_gradient_weights      Fig. 1: omega against W and against log W, one row per advantage sign
  weight_table               omega at chosen log W values, both signs, as a markdown table
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from respo_jax.objectives.kernels import LOG_W_CLAMP
from respo_jax.objectives.policy_losses import OBJECTIVES, ObjectiveSpec, PolicyObjective, get_objective

# Per-token log pi_old of the constructed responses: low enough that log pi = old + log W / T stays a
# log-probability (<= -1) for |log W| <= the clamp at T = 1. The objectives see only differences.
_OLD_LOGP = -(LOG_W_CLAMP + 1.0)


def _as_objective(objective: PolicyObjective | str) -> PolicyObjective:
    if isinstance(objective, str):
        return get_objective(objective)
    if not isinstance(objective, PolicyObjective):
        raise TypeError(f"expected a PolicyObjective or a registered name; got {type(objective).__name__}")
    return objective


_CHUNK = 1024  # responses per call of a compiled weight function (inputs are padded to whole chunks)

# (objective, length) -> (the registry spec it was built from, jitted omega): a replaced user objective
# of the same name and hyperparameters gets a fresh function.
_WEIGHT_FNS: dict[tuple[PolicyObjective, int], tuple[ObjectiveSpec, Callable]] = {}


def _weight_fn(objective: PolicyObjective, length: int) -> Callable:
    spec = OBJECTIVES[objective.name]
    cached = _WEIGHT_FNS.get((objective, length))
    if cached is not None and cached[0] is spec:
        return cached[1]
    old_logp = jnp.full((1, length), _OLD_LOGP, jnp.float32)
    mask = jnp.ones((1, length), jnp.float32)

    def omega(x, a):
        logp = old_logp + x / length
        grad = jax.grad(lambda lp: objective(lp, old_logp, a[None], mask)[0])(logp)
        return -jnp.sum(grad) / a

    fn = jax.jit(jax.vmap(omega))
    _WEIGHT_FNS[(objective, length)] = (spec, fn)
    return fn


def response_gradient_weight(
    objective: PolicyObjective | str, log_w, advantage, length: int = 1
) -> np.ndarray:
    """omega(W; A) (module docstring) of ``objective`` at each ``log_w`` (any shape), float64 NumPy.

    ``advantage``: a non-zero finite scalar or an array broadcasting against ``log_w`` (its sign picks
    the branch; omega does not depend on its size). ``length``: tokens per response, T >= 1.
    Computed as jax.grad of the objective's loss, one response per batch (vmapped and jitted).
    """
    objective = _as_objective(objective)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"length must be an int >= 1 (tokens per response); got {length!r}")
    log_w = np.asarray(log_w, np.float64)
    if not np.all(np.isfinite(log_w)):
        raise ValueError("log_w holds NaN or inf")
    try:
        log_w, advantage = np.broadcast_arrays(log_w, np.asarray(advantage, np.float64))
    except ValueError:
        raise ValueError(f"advantage of shape {np.shape(advantage)} does not broadcast against log_w "
                         f"of shape {log_w.shape}") from None
    if not np.all(np.isfinite(advantage)) or np.any(advantage == 0):
        raise ValueError("advantage must be finite and non-zero (its sign selects the branch)")
    shape = log_w.shape
    if log_w.size == 0:
        return np.zeros(shape)
    # Padded to whole chunks (with log W = 0, A = 1) so that plots and tables of any size share one
    # compiled program per (objective, length).
    flat_w, flat_a = log_w.reshape(-1), advantage.reshape(-1)
    padded = -(-flat_w.size // _CHUNK) * _CHUNK
    flat_w = np.pad(flat_w, (0, padded - flat_w.size))
    flat_a = np.pad(flat_a, (0, padded - flat_a.size), constant_values=1.0)
    fn = _weight_fn(objective, int(length))
    chunks = [fn(jnp.asarray(flat_w[i:i + _CHUNK], jnp.float32), jnp.asarray(flat_a[i:i + _CHUNK], jnp.float32))
              for i in range(0, padded, _CHUNK)]
    values = np.concatenate([np.asarray(chunk, np.float64) for chunk in chunks])[: log_w.size]
    return values.reshape(shape) + 0.0  # + 0.0: no -0.0 where a clip binds


def plot_gradient_weights(
    objectives: Mapping[str, PolicyObjective | str],
    lengths: Mapping[str, int] | None = None,
    w_max: float = 4.0,
    log_w_range: tuple[float, float] = (-8.0, 8.0),
    y_max: float = 2.5,
    num: int = 801,
    title: str = "",
) -> "matplotlib.figure.Figure":  # noqa: F821
    """Fig. 1 for the given objectives (label -> objective or registered name): omega against W in
    (0, w_max] (left) and against log W (right), for A > 0 (top) and A < 0 (bottom).

    ``lengths``: tokens per response by label (default 1), e.g. GSPO's sequence clip at a typical
    length. Weights above ``y_max`` are drawn off the top of the panel. Returns the figure (not shown;
    display it, save it, or close it).
    """
    from matplotlib.figure import Figure

    if not objectives:
        raise ValueError("no objectives to plot")
    lengths = dict(lengths or {})
    unknown = sorted(set(lengths) - set(objectives))
    if unknown:
        raise ValueError(f"lengths given for {unknown}, which are not among the objectives "
                         f"{list(objectives)}")
    if not w_max > 0 or not log_w_range[0] < log_w_range[1]:
        raise ValueError(f"need w_max > 0 and an increasing log_w_range; got {w_max}, {log_w_range}")
    w = np.linspace(w_max / num, w_max, num)
    log_w = np.linspace(*log_w_range, num)
    fig = Figure(figsize=(11.5, 7.0))
    axes = fig.subplots(2, 2, sharey=True)
    for row, (sign, side) in enumerate(((1.0, r"$\hat A > 0$"), (-1.0, r"$\hat A < 0$"))):
        for label, objective in objectives.items():
            length = lengths.get(label, 1)
            name = f"{label} (T={length})" if length != 1 else label
            axes[row, 0].plot(w, response_gradient_weight(objective, np.log(w), sign, length), label=name)
            axes[row, 1].plot(log_w, response_gradient_weight(objective, log_w, sign, length), label=name)
        axes[row, 0].set_xlabel(r"$W = \pi_\theta(o|q)/\pi_{old}(o|q)$")
        axes[row, 1].set_xlabel(r"$\log W$")
        axes[row, 0].set_ylabel(f"gradient weight $\\omega(W)$, {side}")
        for ax in axes[row]:
            ax.axvline(1.0 if ax is axes[row, 0] else 0.0, color="k", lw=0.6, ls=":")
            ax.set_ylim(-0.05, y_max)
            ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_xlim(0, w_max)
        row[1].set_xlim(*log_w_range)
    axes[0, 1].legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def weight_table(
    objectives: Mapping[str, PolicyObjective | str],
    log_w: Sequence[float],
    lengths: Mapping[str, int] | None = None,
) -> str:
    """A markdown table of omega at a few log W values for both signs: one row per objective and sign."""
    lengths = dict(lengths or {})
    log_w = [float(x) for x in log_w]
    header = "| objective | sign | " + " | ".join(f"log W = {x:g}" for x in log_w) + " |"
    lines = [header, "|" + "---|" * (len(log_w) + 2)]
    for label, objective in objectives.items():
        for sign, side in ((1.0, "A > 0"), (-1.0, "A < 0")):
            values = response_gradient_weight(objective, log_w, sign, lengths.get(label, 1))
            lines.append(f"| {label} | {side} | " + " | ".join(f"{v:.4g}" for v in values) + " |")
    return "\n".join(lines)
