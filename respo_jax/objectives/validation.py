"""Input checks for the policy objectives, so bad input fails loudly instead of as a NaN loss.

Shapes and dtypes are static and are always checked, also under ``jit``. Values (NaN/inf, mask
entries) are checked only when the arrays are concrete, i.e. when the objective is called outside
``jit``; inside a traced function they cannot be inspected without a host sync.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True for NumPy/JAX arrays and Python numbers, False for tracers inside jit/grad/vmap."""
    return not isinstance(x, jax.core.Tracer)


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def check_policy_inputs(logp, old_logp, advantages, mask) -> None:
    """Raise ValueError unless logp, old_logp, mask: [batch, seq] float and advantages: [batch] float.

    With concrete arrays also requires: mask entries in {0, 1}; logp and old_logp finite wherever
    mask == 1 (padding may hold anything); advantages finite.
    """
    for name, x in (("logp", logp), ("old_logp", old_logp), ("mask", mask), ("advantages", advantages)):
        if x is None:
            raise ValueError(f"{name} is None; expected an array")
        if not jnp.issubdtype(_dtype(x), jnp.floating):
            hint = " (cast the mask with mask.astype(jnp.float32))" if name == "mask" else ""
            raise ValueError(f"{name} must be a floating-point array; got dtype {_dtype(x)}{hint}")
    shape = _shape(logp)
    if len(shape) != 2:
        raise ValueError(f"logp must have shape [batch, seq]; got shape {shape}")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"logp is empty: shape {shape}; expected at least one response and one position")
    for name, x in (("old_logp", old_logp), ("mask", mask)):
        if _shape(x) != shape:
            raise ValueError(f"{name} has shape {_shape(x)}; logp has {shape}")
    if _shape(advantages) != shape[:1]:
        raise ValueError(f"advantages has shape {_shape(advantages)}; expected [batch] = {shape[:1]}")

    # Under jit every argument is a tracer, under grad only the differentiated ones: check the concrete ones.
    if is_concrete(advantages):
        adv_np = np.asarray(advantages, np.float64)
        if not np.all(np.isfinite(adv_np)):
            raise ValueError(
                f"advantages contain NaN/inf at rows {np.nonzero(~np.isfinite(adv_np))[0][:5].tolist()}"
            )
    if not is_concrete(mask):
        return
    mask_np = np.asarray(mask, np.float64)
    if not np.all((mask_np == 0.0) | (mask_np == 1.0)):
        bad = np.unique(mask_np[(mask_np != 0.0) & (mask_np != 1.0)])[:5]
        raise ValueError(f"mask entries must be 0 or 1; found {bad.tolist()}")
    valid = mask_np > 0
    for name, x in (("logp", logp), ("old_logp", old_logp)):
        if not is_concrete(x):
            continue
        x_np = np.asarray(x, np.float64)
        bad = valid & ~np.isfinite(x_np)
        if np.any(bad):
            rows, cols = np.nonzero(bad)
            raise ValueError(
                f"{name} has {int(bad.sum())} NaN/inf value(s) at response tokens (mask == 1), "
                f"first at [{rows[0]}, {cols[0]}]: {x_np[rows[0], cols[0]]}"
            )


def check_config_keys(cls, values) -> None:
    """ValueError when the config dict ``values`` holds a key that is no field of the dataclass ``cls``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; expected some of {sorted(fields)}")
