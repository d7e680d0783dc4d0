"""DAPO's soft overlong penalty, added to the strict-box reward in the paper's 30B runs (§4.1, App. D.1).

The penalty is zero through `max_response_length − buffer_length` tokens and falls linearly to
`−penalty_factor` at `max_response_length` (paper: 0 through 4,096 tokens, −1 at 8,192). It works on
Python numbers, NumPy arrays and JAX arrays (also under `jit`), elementwise and without side effects.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any


def _validate(max_response_length: Any, buffer_length: Any, penalty_factor: Any) -> None:
    for name, value in (("max_response_length", max_response_length), ("buffer_length", buffer_length)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an int; got {type(value).__name__}: {value!r}")
    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be positive; got {max_response_length}")
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"buffer_length must be in (0, max_response_length={max_response_length}]; got {buffer_length} "
            "(the penalty divides by it; use penalty_factor=0 to switch the penalty off)"
        )
    if (
        isinstance(penalty_factor, bool)
        or not isinstance(penalty_factor, numbers.Real)
        or not math.isfinite(penalty_factor)
        or penalty_factor < 0
    ):
        raise ValueError(f"penalty_factor must be a finite number >= 0; got {penalty_factor!r}")


def _is_jax_array(value: Any) -> bool:
    # Only a process that imported JAX can hold a JAX array, so JAX is never imported here for NumPy users
    # (the Math-Verify worker processes import this package and must stay light).
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.Array)


def overlong_penalty(
    length: Any,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Any:
    """Soft length penalty in [−penalty_factor, 0] for a response of `length` tokens.

        penalty(L) = min(0, −(L − (max − buffer)) / buffer · factor),  clamped below at −factor.

    `length` counts response tokens as the trainer's response mask does (EOS included). Beyond
    `max_response_length` the penalty stays at −factor: DAPO's formula has no lower clamp because the
    sampler can never exceed the limit, and App. D.1 states the penalty lies in [−1, 0] for factor 1, so
    the clamp only matters for callers that pass longer lengths and keeps the stated range.

    Args:
      length: a non-negative Python int/float (returns a float), or an integer/float NumPy or JAX array of
        any shape such as [batch] (returns an array of that shape: float64 for NumPy integer input,
        float32 for JAX).
      max_response_length: L_max, the response limit (int > 0).
      buffer_length: width of the linear ramp (int, 0 < buffer <= max).
      penalty_factor: penalty at and beyond L_max, as a positive magnitude (>= 0).
    """
    _validate(max_response_length, buffer_length, penalty_factor)
    expected_length = max_response_length - buffer_length
    scale = float(penalty_factor) / buffer_length
    if isinstance(length, numbers.Real) and not isinstance(length, bool):
        if not math.isfinite(length) or length < 0:
            raise ValueError(f"length must be a finite number >= 0; got {length!r}")
        exceed = float(length) - expected_length
        return float(min(0.0, max(-float(penalty_factor), -exceed * scale)))
    if _is_jax_array(length):
        import jax.numpy as xp  # noqa: PLC0415  (imported only when a JAX array is passed)
    else:
        import numpy as xp  # noqa: PLC0415
    values = xp.asarray(length)
    if not (xp.issubdtype(values.dtype, xp.integer) or xp.issubdtype(values.dtype, xp.floating)):
        raise ValueError(f"length must hold integers or floats; got dtype {values.dtype}")
    exceed = values - expected_length
    return xp.clip(-exceed * scale, -float(penalty_factor), 0.0)
