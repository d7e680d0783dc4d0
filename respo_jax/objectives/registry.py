"""Adding objectives without editing the package: a kernel of the sequence weight becomes an objective
that ``get_objective``, the trainer's ``objective.name`` and the notebooks resolve like the built-ins.

ReSPO is one member of the (alpha, beta, lambda) family of Eq. 12 (§3.3); any other member, or any
non-negative function of log W, trains the same way, -sg(phi(W; A)) A log pi (Alg. 1):

    from respo_jax.objectives import kernel_objective, register_objective, reshaping_objective
    register_objective("respo_a3", reshaping_objective(alpha=(3.0, 1.0), beta=(0.5, 0.5), lam=(1.5, 2.0)))
    register_objective("sech", kernel_objective(lambda log_w, adv, width: 1 / jnp.cosh(log_w / width),
                                               defaults={"width": 2.0}))
    experiments.train.main(["objective.name=sech", "objective.hparams.width=4"])

Registration is per process and is checked: the name must be new (built-ins cannot be replaced), the
spec well formed, and the objective must give a finite loss, gradient and metrics on a probe batch
with |log W| at the clamp for both advantage signs. A command-line run sees an objective that its
config file registers (``--config my_config.py`` registering before ``get_config`` returns).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from respo_jax.objectives import kernels
from respo_jax.objectives.policy_losses import (
    OBJECTIVES,
    ObjectiveSpec,
    PolicyObjective,
    TokenLoss,
    checker_for_reshaping_family,
    get_objective,
    respo_token_loss,
)

# The names the package ships; they can be neither replaced nor removed.
BUILTIN_OBJECTIVES = OBJECTIVES.freeze_builtins()

# log W values the kernel and registration probes cover: both clamp ends, the on-policy point, the tails.
_PROBE_LOG_W = np.linspace(-kernels.LOG_W_CLAMP, kernels.LOG_W_CLAMP, 81)


def _real_or_pair(key: str, value) -> float | tuple[float, float]:
    """A real number, or a (positive-branch, negative-branch) pair of them, as hashable floats."""

    def real(name, x) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
            raise ValueError(f"hyperparameter {name} must be a real number; got {x!r}")
        if not math.isfinite(float(x)):
            raise ValueError(f"hyperparameter {name} must be finite; got {x!r}")
        return float(x)

    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(
                f"hyperparameter {key} must be a number or a (positive-branch, negative-branch) pair; "
                f"got {value!r}"
            )
        return (real(f"{key}[0]", value[0]), real(f"{key}[1]", value[1]))
    return real(key, value)


def _check_numbers(hparams: dict) -> dict:
    """Default check of ``kernel_objective``: every value a finite number or a pair of them."""
    return {key: _real_or_pair(key, value) for key, value in hparams.items()}


def _kernel_token_loss(kernel: Callable[..., Any]) -> Callable[..., TokenLoss]:
    """-sg(phi) A log pi per token, phi = kernel(log_w, advantages, **hparams): ReSPO's form (Alg. 1)."""

    def token_loss(logp, old_logp, advantages, mask, log_w, **hparams) -> TokenLoss:
        phi = jnp.asarray(kernel(log_w, advantages, **hparams))
        if phi.shape != log_w.shape:
            raise ValueError(f"the kernel returned shape {phi.shape}; expected one weight per response, "
                             f"{log_w.shape}")
        phi = jax.lax.stop_gradient(phi.astype(jnp.float32))
        loss = -(phi * advantages)[:, None] * logp
        return TokenLoss(loss=loss, coefficient=jnp.broadcast_to(phi[:, None], logp.shape), metrics={})

    token_loss.__name__ = f"kernel_token_loss[{getattr(kernel, '__name__', 'kernel')}]"
    return token_loss


def _probe_kernel(kernel: Callable[..., Any], hparams: dict) -> None:
    """The kernel must map log W in [-20, 20], either sign, to finite non-negative weights of its shape."""
    log_w = jnp.asarray(np.concatenate([_PROBE_LOG_W, _PROBE_LOG_W]), jnp.float32)
    advantages = jnp.asarray(np.repeat([1.0, -1.0], _PROBE_LOG_W.size), jnp.float32)
    try:
        phi = np.asarray(kernel(log_w, advantages, **hparams), np.float64)
    except Exception as err:  # report any failure of user code as a bad kernel, with its cause
        raise ValueError(f"the kernel failed on log W in [-20, 20] with hparams {hparams}: {err!r}") from err
    if phi.shape != log_w.shape:
        raise ValueError(f"the kernel returned shape {phi.shape} for log_w of shape {log_w.shape}; it must "
                         "return one weight per response")
    bad = ~np.isfinite(phi) | (phi < 0)
    if np.any(bad):
        index = int(np.argmax(bad))
        raise ValueError(
            f"the kernel must give finite weights >= 0 (a negative weight flips the advantage's sign); got "
            f"{phi[index]} at log W = {float(log_w[index]):g}, A {'>=' if advantages[index] > 0 else '<'} 0"
        )


def kernel_objective(
    kernel: Callable[..., Any],
    defaults: Mapping[str, Any] | None = None,
    check: Callable[[dict], dict] | None = None,
    *,
    aggregation: str = "token-mean",
    token_log_ratio_clamp: float | None = None,
    scale_advantages: bool = True,
) -> ObjectiveSpec:
    """An objective from a sequence-weight kernel: token loss -sg(phi(W_i; A_i)) A_i log pi[i, t].

    ``kernel(log_w, advantages, **hparams) -> phi``: ``log_w, advantages: [batch]`` float32 (log W is
    clamped to +-20, computed in log space as for ReSPO), ``phi: [batch]`` finite and >= 0; a pure,
    jittable JAX function (it is traced inside the policy update). ``defaults``: its hyperparameters'
    default values; ``check(hparams) -> hparams`` validates a full set (default: each value a finite
    number or a (A >= 0, A < 0) pair of them). The other arguments are those of ``ObjectiveSpec``.
    The kernel is probed at once on log W in [-20, 20] for both signs; a bad one raises ValueError.
    """
    if not callable(kernel):
        raise TypeError(f"kernel must be a function of (log_w, advantages, **hparams); got {kernel!r}")
    defaults = dict(defaults or {})
    check = _check_numbers if check is None else check
    spec = ObjectiveSpec(
        _kernel_token_loss(kernel),
        defaults,
        check,
        aggregation=aggregation,
        token_log_ratio_clamp=token_log_ratio_clamp,
        scale_advantages=scale_advantages,
    )
    _probe_kernel(kernel, check(dict(defaults)))
    return spec


def reshaping_objective(
    alpha: tuple[float, float],
    beta: tuple[float, float],
    lam: tuple[float, float],
    *,
    aggregation: str = "token-mean",
    scale_advantages: bool = True,
) -> ObjectiveSpec:
    """A two-branch member of the (alpha, beta, lambda) family, Eq. 12 per advantage sign, trained as
    ReSPO is: each argument is an (A >= 0 branch, A < 0 branch) pair, checked against the family
    (beta in [0, 1] unless alpha = 1, lam >= 0). ReSPO itself is alpha=(2, 1), beta=(1/2, 1/2),
    lam=(2, 2); the pairs are the new objective's defaults and stay overridable by name."""
    check = checker_for_reshaping_family("(alpha, beta, lam) kernel")
    defaults = check({"alpha": alpha, "beta": beta, "lam": lam})
    return ObjectiveSpec(
        respo_token_loss, defaults, check, aggregation=aggregation, scale_advantages=scale_advantages
    )


def _probe_objective(objective: PolicyObjective) -> None:
    """Finite loss, gradient, metrics and per-response outputs on extreme and ordinary log W, both signs,
    with a padded position: what every built-in objective guarantees (tests/test_objectives.py)."""
    seq = 3
    shifts = np.array([30.0, -30.0, 0.6, -0.6, 30.0, -30.0, 0.6, -0.6])[:, None] / seq  # raw log W +-30
    old_logp = np.full((shifts.shape[0], seq), -2.0, np.float32)
    logp = (old_logp + shifts).astype(np.float32)
    advantages = np.repeat(np.float32([1.0, -1.0]), 4)
    mask = np.ones_like(logp)
    mask[:, -1] = np.float32([1, 0, 1, 0, 1, 0, 1, 0])

    def loss(x):
        out = objective.evaluate(x, old_logp, advantages, mask)
        return out.terms.loss(), out

    (value, out), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logp))
    problems = []
    if not np.isfinite(float(value)):
        problems.append(f"loss {float(value)}")
    if not np.all(np.isfinite(np.asarray(grad))):
        problems.append("non-finite gradient")
    problems += [f"metric {k} = {float(v)}" for k, v in out.metrics.items() if not np.isfinite(float(v))]
    for key, values in out.responses.items():
        if np.shape(values) != (logp.shape[0],) or not np.all(np.isfinite(np.asarray(values))):
            problems.append(f"per-response {key} {np.asarray(values)!r}")
    if problems:
        raise ValueError("non-finite output: " + "; ".join(problems))


def register_objective(name: str, spec: ObjectiveSpec, *, replace: bool = False) -> PolicyObjective:
    """Adds ``spec`` to the registry as ``name`` and returns ``get_objective(name)`` (its defaults).

    ``name``: a letter, then letters, digits, ``_`` or ``-``; a built-in name raises ValueError, and so
    does a name already registered unless ``replace=True`` (which replaces an earlier user objective).
    The objective is probed before this returns (see the module docstring); when the probe fails,
    the registry is left as it was and ValueError names the objective and the problem.
    """
    OBJECTIVES.check_new(name, replace, isinstance(spec, ObjectiveSpec),
                         "an ObjectiveSpec (kernel_objective, reshaping_objective or ObjectiveSpec(...))",
                         type(spec).__name__)
    previous = OBJECTIVES.get(name)
    OBJECTIVES[name] = spec
    try:
        objective = get_objective(name)
        _probe_objective(objective)
    except Exception as err:
        if previous is None:
            del OBJECTIVES[name]
        else:
            OBJECTIVES[name] = previous
        raise ValueError(f"objective {name!r} was not registered: {err}") from err
    return objective


def unregister_objective(name: str) -> None:
    """Removes a user-registered objective; built-ins raise ValueError, unknown names KeyError."""
    OBJECTIVES.remove(name)
