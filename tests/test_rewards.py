"""The training reward of the paper (App. D.1): the DAPO strict-box verifier and the soft overlong penalty.

Strict-box cases are written by hand from the verifier's rules (last 100 characters, last `\\boxed{`,
every brace counts, exact string equality); the penalty is checked against its closed form.
"""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from respo_jax.rewards import last_strict_box, overlong_penalty, strict_box_score, strict_box_scores

PAD = "The reasoning goes on for a while. " * 20  # 700 characters of box-free text

# (solution, ground truth, expected score, what the case pins down)
STRICT_BOX_CASES = [
    ("\\boxed{42}", "42", 1.0, "bare box"),
    ("So the answer is $\\boxed{42}$.", "42", 1.0, "box inside math mode, trailing period"),
    (PAD + "Final answer: \\boxed{42}", "42", 1.0, "long solution, box at the end"),
    ("\\boxed{ 42}", "42", -1.0, "leading space inside the box"),
    ("\\boxed{42 }", "42", -1.0, "trailing space inside the box"),
    ("\\boxed{42}", " 42", -1.0, "whitespace in the ground truth is not stripped either"),
    ("\\boxed {42}", "42", -1.0, "space between \\boxed and the brace: no box"),
    ("\\boxed 42", "42", -1.0, "brace-less \\boxed: no box"),
    ("\\fbox{42}", "42", -1.0, "\\fbox is not \\boxed"),
    ("\\Boxed{42}", "42", -1.0, "case matters"),
    ("The answer is 42.", "42", -1.0, "no box at all"),
    ("\\boxed{42.0}", "42", -1.0, "no numeric normalization"),
    ("\\boxed{042}", "42", -1.0, "no leading-zero normalization"),
    ("\\boxed{\\text{42}}", "42", -1.0, "no LaTeX normalization"),
    ("\\boxed{{42}}", "42", -1.0, "outer braces are kept in the content"),
    ("\\boxed{{42}}", "{42}", 1.0, "... and match when the ground truth has them"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, "nested braces are balanced"),
    ("\\boxed{\\frac{1}{2}}", "1/2", -1.0, "equal value, different string"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0, "two levels of nesting"),
    ("\\boxed{a}b}", "a", 1.0, "content ends at the first balancing brace"),
    ("\\boxed{42", "42", -1.0, "unclosed box"),
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", -1.0, "unclosed after nested braces"),
    ("\\boxed{42\\}", "42", -1.0, "an escaped closing brace closes the box: content is 42 and a backslash"),
    ("\\boxed{42\\}", "42\\", 1.0, "... which is what it matches"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1.0, "escaped braces count and balance"),
    ("\\boxed{1\\}2}", "1\\", 1.0, "escaped closing brace ends the content early"),
    ("\\boxed{41} then \\boxed{42}", "42", 1.0, "the last box wins"),
    ("\\boxed{42} then \\boxed{41}", "42", -1.0, "an earlier correct box does not help"),
    ("\\boxed{42} and then \\boxed{4", "42", -1.0, "last opener unclosed: no fallback to the earlier box"),
    ("\\boxed{\\boxed{42}}", "42", 1.0, "nested box: the last opener is the inner one"),
    ("\\boxed{\\boxed{42}}", "\\boxed{42}", -1.0, "... so the outer content is never compared"),
    ("\\\\boxed{42}", "42", 1.0, "a doubled backslash still contains \\boxed{"),
    ("\\boxed{}", "", 1.0, "empty box equals empty ground truth"),
    ("no box", "", -1.0, "no box never equals the empty ground truth"),
    ("答案是 \\boxed{42}。", "42", 1.0, "non-ASCII text around the box"),
    ("\\boxed{四十二}", "四十二", 1.0, "non-ASCII content"),
    ("\\boxed{42}" + "x" * 90, "42", 1.0, "box starts exactly 100 characters from the end"),
    ("\\boxed{42}" + "x" * 91, "42", -1.0, "box starts 101 characters from the end: invisible"),
    ("\\boxed{42" + "x" * 90 + "}", "42" + "x" * 90, 1.0, "a 100-character box fills the window"),
    ("\\boxed{42" + "x" * 91 + "}", "42" + "x" * 91, -1.0, "a 101-character box: its opener is cut"),
    ("\\boxed{42}" + "x" * 95 + "\\boxed{", "42", -1.0, "only a dangling opener in the window"),
    (PAD + "\\boxed{42}" + PAD, "42", -1.0, "box in the middle of a long solution"),
    ("\\boxed{42}" + "y" * 300, "42", -1.0, "box before the 300-character cut"),
    ("xx\\boxed{42}" + "{" * 5 + "}" * 5, "42", 1.0, "balanced braces after the box do not matter"),
    ("$\\boxed{-\\frac{\\pi}{4}}$ is it.", "-\\frac{\\pi}{4}", 1.0, "signs and commands kept verbatim"),
]


@pytest.mark.parametrize(
    "solution,truth,expected,why", STRICT_BOX_CASES, ids=[case[3] for case in STRICT_BOX_CASES]
)
def test_strict_box_held_out_cases(solution, truth, expected, why):
    assert strict_box_score(solution, truth) == expected, why


def test_strict_box_batch_matches_single_calls():
    solutions = [case[0] for case in STRICT_BOX_CASES]
    truths = [case[1] for case in STRICT_BOX_CASES]
    scores = strict_box_scores(solutions, truths)
    assert scores.shape == (len(STRICT_BOX_CASES),) and scores.dtype == np.float32
    np.testing.assert_array_equal(scores, [case[2] for case in STRICT_BOX_CASES])
    assert strict_box_scores([], []).shape == (0,)


def test_last_strict_box_extracts_balanced_content():
    assert last_strict_box("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"
    assert last_strict_box("\\boxed{1} \\boxed{2}") == "2"
    assert last_strict_box("\\boxed{1") is None
    assert last_strict_box("nothing") is None


def test_strict_box_rejects_non_strings():
    with pytest.raises(ValueError, match="solution must be a str; got int"):
        strict_box_score(42, "42")
    with pytest.raises(ValueError, match="ground_truth must be a str; got int"):
        strict_box_score("\\boxed{42}", 42)
    with pytest.raises(ValueError, match="same length; got 2 and 1"):
        strict_box_scores(["a", "b"], ["a"])


box_free_text = st.text(alphabet=st.characters(blacklist_characters="\\{}"), max_size=150)


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.text(max_size=400),
    truth=st.from_regex(r"-?[0-9]{1,12}", fullmatch=True),
    suffix=box_free_text,
)
def test_strict_box_sees_a_box_iff_it_starts_in_the_last_100_characters(prefix, truth, suffix):
    box = "\\boxed{" + truth + "}"
    solution = prefix + box + suffix
    expected = 1.0 if len(box) + len(suffix) <= 100 else -1.0
    assert strict_box_score(solution, truth) == expected


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(max_size=200),
    truth=st.from_regex(r"[0-9]{1,6}", fullmatch=True),
    other=st.from_regex(r"[0-9]{1,6}", fullmatch=True),
)
def test_strict_box_is_exact_string_equality(prefix, truth, other):
    solution = prefix + "\\boxed{" + other + "}"
    assert strict_box_score(solution, truth) == (1.0 if other == truth else -1.0)


# ---------------------------------------------------------------------------------- overlong penalty


def closed_form_penalty(length: int, max_len: int, buffer: int, factor: Fraction) -> Fraction:
    """DAPO's piecewise-linear penalty, exactly: 0, then a linear ramp, then −factor."""
    start = max_len - buffer
    if length <= start:
        return Fraction(0)
    if length >= max_len:
        return -factor
    return -factor * Fraction(length - start, buffer)


def test_overlong_penalty_paper_setting():
    # Paper §4.1 (30B): zero through 4,096 tokens, then linear to −1 at the 8,192-token limit.
    def penalty(length):
        return overlong_penalty(length, max_response_length=8192, buffer_length=4096, penalty_factor=1.0)

    assert penalty(0) == 0.0
    assert penalty(4096) == 0.0
    assert penalty(4097) == pytest.approx(-1 / 4096)
    assert penalty(6144) == pytest.approx(-0.5)
    assert penalty(8192) == pytest.approx(-1.0)
    assert penalty(10_000) == -1.0  # clamped: App. D.1 keeps the penalty in [−1, 0]


@settings(max_examples=400, deadline=None)
@given(
    max_len=st.integers(1, 40_000),
    buffer_frac=st.fractions(Fraction(0), Fraction(1)),
    factor=st.fractions(Fraction(0), Fraction(5), max_denominator=64),
    length_frac=st.fractions(Fraction(0), Fraction(3, 2)),
)
def test_overlong_penalty_matches_closed_form(max_len, buffer_frac, factor, length_frac):
    buffer = max(1, int(buffer_frac * max_len))
    length = int(length_frac * max_len)
    expected = closed_form_penalty(length, max_len, buffer, factor)
    got = overlong_penalty(length, max_len, buffer, float(factor))
    assert isinstance(got, float)
    assert got == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
    assert -float(factor) <= got <= 0.0


@settings(max_examples=50, deadline=None)
@given(
    max_len=st.integers(2, 20_000),
    buffer_frac=st.floats(0.01, 1.0),
    factor=st.floats(0.0, 3.0),
    lengths=st.lists(st.integers(0, 30_000), min_size=1, max_size=16),
)
def test_overlong_penalty_arrays_match_scalars(max_len, buffer_frac, factor, lengths):
    buffer = max(1, int(buffer_frac * max_len))
    scalar = np.array([overlong_penalty(n, max_len, buffer, factor) for n in lengths])
    numpy_result = overlong_penalty(np.asarray(lengths, dtype=np.int64), max_len, buffer, factor)
    assert isinstance(numpy_result, np.ndarray) and numpy_result.shape == (len(lengths),)
    np.testing.assert_allclose(numpy_result, scalar, rtol=1e-12, atol=1e-12)
    jax_result = overlong_penalty(jnp.asarray(lengths, dtype=jnp.int32), max_len, buffer, factor)
    assert isinstance(jax_result, jax.Array) and jax_result.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(jax_result), scalar, rtol=1e-5, atol=1e-5)


def test_overlong_penalty_under_jit_is_elementwise_and_monotone():
    penalty = jax.jit(lambda lengths: overlong_penalty(lengths, 8192, 4096, 1.0))
    lengths = jnp.arange(0, 9000, 7, dtype=jnp.int32).reshape(-1, 1)  # [n, 1]: any shape is kept
    values = np.asarray(penalty(lengths))
    assert values.shape == lengths.shape
    assert np.all(np.diff(values[:, 0]) <= 0) and values.min() == -1.0 and values.max() == 0.0
    expected = [float(closed_form_penalty(int(n), 8192, 4096, Fraction(1))) for n in range(0, 9000, 7)]
    np.testing.assert_allclose(values[:, 0], expected, atol=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        ((100, 0, 200, 1.0), "max_response_length must be positive; got 0"),
        ((100, 4096, 0, 1.0), r"buffer_length must be in \(0, max_response_length=4096\]; got 0"),
        ((100, 4096, 5000, 1.0), r"buffer_length must be in \(0, max_response_length=4096\]; got 5000"),
        ((100, 4096, -1, 1.0), "buffer_length must be in"),
        ((100, 4096.0, 1024, 1.0), "max_response_length must be an int; got float"),
        ((100, 4096, 1024, -1.0), "penalty_factor must be a finite number >= 0; got -1.0"),
        ((100, 4096, 1024, float("nan")), "penalty_factor must be a finite number >= 0"),
        ((-1, 4096, 1024, 1.0), "length must be a finite number >= 0; got -1"),
        ((np.array(["a"]), 4096, 1024, 1.0), "length must hold integers or floats"),
    ],
)
def test_overlong_penalty_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(*args)
