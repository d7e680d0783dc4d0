"""The DAPO strict-box verifier: the ±1 training reward of the paper's DAPO-MATH runs (App. D.1).

Training examples carry the data-source key `math_dapo`, which selects this verifier (not Math-Verify,
which scores the evaluation benchmarks). It is a plain string comparison on the tail of the response,
and the paper's training scores depend on its exact quirks, so they are reproduced here on purpose.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

BOX_OPENER = "\\boxed{"
TAIL_CHARS = 300  # the solution is first cut to its last 300 characters ...
SEARCH_CHARS = 100  # ... and the box is searched for in the last 100 of those


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str; got {type(value).__name__}: {value!r:.80}")


def brace_balanced_content(text: str, content_start: int) -> str | None:
    """The text from `content_start` (just after an opening `{`) up to the `}` that closes it, or None.

    Every `{` is +1 and every `}` is −1, escaped or not; None when the count never returns to zero.
    """
    depth = 1  # the opener's own `{`
    for position in range(content_start, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:position]
    return None


def last_strict_box(solution: str) -> str | None:
    """The content of the last `\\boxed{...}` that lies entirely in the last 100 characters, or None.

    Semantics (the DAPO strict-box rules, character for character):
      1. keep the last 300 characters of `solution`, then the last 100 of those (so, in effect, the last
         100 characters: the 300-character cut never changes the result);
      2. find the *last* occurrence of the literal `\\boxed{` in that window (`\\boxed {`, `\\fbox{`,
         `\\boxed 5` do not match; a `\\boxed{` that starts before the window is invisible, even when its
         closing brace is inside it);
      3. from the `{` of that opener, count braces: every `{` is +1 and every `}` is −1, escaped or not
         (`\\{` and `\\}` count too); the content ends at the brace that brings the count back to zero;
      4. if the count never returns to zero inside the window, there is no box (None), even when an
         earlier box in the window is closed.
    A doubled backslash (`\\\\boxed{`) still contains `\\boxed{`, so it matches.
    """
    _check_str("solution", solution)
    window = solution[-TAIL_CHARS:][-SEARCH_CHARS:]
    start = window.rfind(BOX_OPENER)
    if start < 0:
        return None
    return brace_balanced_content(window, start + len(BOX_OPENER))


def strict_box_score(solution: str, ground_truth: str) -> float:
    """+1.0 iff the last strict box of `solution` equals `ground_truth` exactly, else −1.0 (App. D.1).

    The comparison is plain string equality with no normalization at all: `\\boxed{ 42}`, `\\boxed{42.0}`,
    `\\boxed{042}` and `\\boxed{{42}}` all score −1 against "42". No box, an unclosed box, or a box that
    starts more than 100 characters from the end also score −1. See `last_strict_box` for the extraction
    rules. An empty ground truth matches an empty box `\\boxed{}` (and nothing else).
    """
    _check_str("ground_truth", ground_truth)
    return 1.0 if last_strict_box(solution) == ground_truth else -1.0


def strict_box_scores(solutions: Sequence[str], ground_truths: Sequence[str]) -> np.ndarray:
    """`strict_box_score` over a batch: solutions [batch], ground_truths [batch] -> float32 [batch] of ±1."""
    if len(solutions) != len(ground_truths):
        raise ValueError(
            f"solutions and ground_truths must have the same length; got {len(solutions)} and "
            f"{len(ground_truths)}"
        )
    return np.asarray(
        [strict_box_score(solution, truth) for solution, truth in zip(solutions, ground_truths)],
        dtype=np.float32,
    ).reshape(len(solutions))
