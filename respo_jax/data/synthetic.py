"""A synthetic verifiable task and an in-process character tokenizer, for CPU-scale ReSPO runs.

The paper trains on DAPO-Math with a strict-box reward (App. D.1); at CPU scale the same loop runs on
small arithmetic whose answer is written in `\\boxed{}` and scored by the same verifier, with no
download. Problems are `"3+4="`, answers exact integer strings (`"7"`).

Response format. By default (`boxed_prefix=True`) the prompt already ends with `\\boxed{` (the
`PromptFormat.response_prefix`), so the model only writes `7}` and EOS: two tokens plus EOS on the
easy level, which a tiny model reaches by chance often enough for RL to get a signal. The reward must
score `task.prompt_format.solution_text(response)` (`"\\boxed{" + response`). With
`boxed_prefix=False` the model writes `\\boxed{7}` itself.

Difficulty knobs: digits per operand, number of operands (fixed, or drawn per problem from
[min_operands, num_operands]), operation mix (`+`, `-`, `*`, usual precedence). Longer answers mean
longer responses, so length effects and rollout reuse show; `DIFFICULTIES` holds the named levels.
Records are a pure function of (seed, index), independent of NumPy versions: each draw hashes
`seed:index:draw` with SHA-256.

Scratchpad (`scratchpad=True`, `+`/`-` only): the response works left to right, one equation per step,
before boxing the result — `"12+34-5="` is answered `"12+34=46 46-5=41 \\boxed{41}"` — so responses are
tens of tokens long and their length grows with the number of operands (the paper's length effects,
§4.3 and App. E.3, need positive responses whose sequence log-weight accumulates over many tokens).
Only the boxed answer is scored, as in DAPO-Math.

Held-out split (`test_fraction > 0`): each distinct problem text belongs to "train" or "test" by a
SHA-256 hash of the text, so `make_records(..., split="train")` and `split="test"` never share a problem,
whatever their seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Sequence

from respo_jax.data.prompts import PromptFormat

BOXED_OPEN = "\\boxed{"
ALPHABET = "0123456789+-*=\\boxed{} "
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
UNKNOWN_CHAR = "\ufffd"


class CharTokenizer:
    """One token per character of `alphabet`, after the specials pad=0, bos=1, eos=2.

    Same interface as `tokenizer.HFTokenizer` (the `Tokenizer` protocol). `encode(...,
    add_special_tokens=True)` prepends BOS (raw prompts); ids outside the vocabulary (a model vocab
    padded past `vocab_size`) decode to U+FFFD, so they can never form a correct answer.
    """

    def __init__(self, alphabet: str = ALPHABET):
        chars = list(dict.fromkeys(alphabet))
        if len(chars) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self._tokens = list(SPECIAL_TOKENS) + chars
        self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self.vocab_size = len(self._tokens)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_id] if add_special_tokens else []
        for pos, char in enumerate(text):
            if char not in self._ids:
                raise ValueError(
                    f"character {char!r} at position {pos} of {text!r} is not in the alphabet "
                    f"{''.join(self._tokens[len(SPECIAL_TOKENS):])!r}"
                )
            ids.append(self._ids[char])
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(text, add_special_tokens) for text in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces = []
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < len(SPECIAL_TOKENS):
                if not skip_special_tokens:
                    pieces.append(SPECIAL_TOKENS[token_id])
            elif 0 <= token_id < self.vocab_size:
                pieces.append(self._tokens[token_id])
            else:
                pieces.append(UNKNOWN_CHAR)
        return "".join(pieces)

    def token_to_id(self, token: str) -> int | None:
        if token in SPECIAL_TOKENS:
            return SPECIAL_TOKENS.index(token)
        return self._ids.get(token)

    @property
    def has_chat_template(self) -> bool:
        return False

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise ValueError("CharTokenizer has no chat template; the synthetic task renders prompts raw")


def evaluate(operands: Sequence[int], operations: Sequence[str]) -> int:
    """The value of operands[0] op[0] operands[1] ... with `*` before `+`/`-`, left to right."""
    if len(operations) != len(operands) - 1:
        raise ValueError(
            f"need {len(operands) - 1} operations for {len(operands)} operands; got {len(operations)}"
        )
    terms, signs = [operands[0]], [1]
    for op, value in zip(operations, operands[1:]):
        if op == "*":
            terms[-1] *= value
        elif op in "+-":
            terms.append(value)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"unknown operation {op!r}; expected one of '+', '-', '*'")
    return sum(s * t for s, t in zip(signs, terms))


def _draw(seed: int, index: int, draw: int, bound: int) -> int:
    """A uniform integer in [0, bound) from SHA-256 of (seed, index, draw); bias < 2**-60."""
    digest = hashlib.sha256(f"{seed}:{index}:{draw}".encode()).digest()
    return int.from_bytes(digest[:16], "little") % bound


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Arithmetic problems with integer answers in `\\boxed{}`.

    num_digits: each operand is uniform in [0, 10**num_digits).
    num_operands: operands per problem (>= 2); the largest count when `min_operands` is set.
    min_operands: 0 (every problem has `num_operands`) or the smallest count (2 <= min <= num_operands):
      each problem draws its count uniformly from [min_operands, num_operands].
    operations: the operation mix, drawn uniformly per slot, e.g. "+", "+-", "+-*".
    boxed_prefix: the prompt ends with `\\boxed{` (see module doc).
    scratchpad: the response writes each step's equation before the boxed answer (module doc); needs
      boxed_prefix=False and operations from "+-".
    test_fraction: the share of distinct problems that form the held-out "test" split (0: no split).
    align: left-pad every problem text with spaces to the longest problem's width, so all prompts have
      one token length (a trainer that pads batches to their longest prompt then compiles one shape).
    """

    num_digits: int = 1
    num_operands: int = 2
    operations: str = "+"
    boxed_prefix: bool = True
    min_operands: int = 0
    scratchpad: bool = False
    test_fraction: float = 0.0
    align: bool = False

    def __post_init__(self):
        if self.num_digits < 1 or self.num_operands < 2:
            raise ValueError(
                f"need num_digits >= 1 and num_operands >= 2; got {self.num_digits}, {self.num_operands}"
            )
        if self.min_operands and not 2 <= self.min_operands <= self.num_operands:
            raise ValueError(f"min_operands must be 0 or in [2, num_operands={self.num_operands}]; "
                             f"got {self.min_operands}")
        if (
            not self.operations
            or set(self.operations) - set("+-*")
            or len(set(self.operations)) != len(self.operations)
        ):
            raise ValueError(f"operations must be distinct characters from '+-*'; got {self.operations!r}")
        if self.scratchpad and (self.boxed_prefix or "*" in self.operations):
            raise ValueError("scratchpad=True needs boxed_prefix=False (the box follows the steps) and "
                             f"operations from '+-' (steps run left to right); got boxed_prefix="
                             f"{self.boxed_prefix}, operations={self.operations!r}")
        if not 0.0 <= self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in [0, 1); got {self.test_fraction}")

    @property
    def operand_counts(self) -> tuple[int, int]:
        """(smallest, largest) operand count of the task's problems, bounds included."""
        return self.min_operands or self.num_operands, self.num_operands

    @property
    def prompt_format(self) -> PromptFormat:
        """Raw prompt = problem (+ `\\boxed{` when boxed_prefix); score `solution_text(response)`."""
        return PromptFormat(
            template="{problem}", chat=False, response_prefix=BOXED_OPEN if self.boxed_prefix else ""
        )

    def reference_response(self, answer: str, problem: str | None = None) -> str:
        """The correct response text (without EOS) boxing `answer`, e.g. for a supervised warm-up: the
        shortest one, or with `scratchpad` the steps of `problem` (required then) before the box."""
        boxed = f"{answer}}}" if self.boxed_prefix else f"{BOXED_OPEN}{answer}}}"
        if not self.scratchpad:
            return boxed
        if problem is None:
            raise ValueError("a scratchpad response needs the problem text (reference_response(answer, problem))")
        return " ".join(scratchpad_steps(problem) + [boxed])

    def reference_solution(self, record: dict[str, str]) -> str:
        """`reference_response` of a record (its answer, and its problem's steps with `scratchpad`)."""
        return self.reference_response(record["answer"], record["problem"])

    def record(self, seed: int, index: int) -> dict[str, str]:
        """Problem `index` of the stream `seed`: {"problem": "3+4=", "answer": "7", "id": "seed-index"}."""
        count = self.num_operands
        if self.min_operands:  # a draw index past those of the operands and operations
            count = self.min_operands + _draw(seed, index, 2 * self.num_operands,
                                              self.num_operands - self.min_operands + 1)
        operands = [_draw(seed, index, k, 10**self.num_digits) for k in range(count)]
        ops = [
            self.operations[_draw(seed, index, self.num_operands + k, len(self.operations))]
            for k in range(count - 1)
        ]
        problem = str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:])) + "="
        if self.align:
            problem = problem.rjust(self.num_operands * (self.num_digits + 1))
        return {"problem": problem, "answer": str(evaluate(operands, ops)), "id": f"{seed}-{index}"}

    def split_of(self, problem: str) -> str:
        """"test" for the `test_fraction` share of problem texts (by SHA-256 of the text), else "train"."""
        digest = hashlib.sha256(f"split:{problem}".encode()).digest()
        return "test" if int.from_bytes(digest[:8], "little") < self.test_fraction * 2**64 else "train"

    def make_records(self, num_records: int, seed: int, split: str = "all") -> list[dict[str, str]]:
        """`num_records` problems, deterministic in `seed`.

        split "all": record i is `record(seed, i)`; "train" / "test" (needs test_fraction > 0): the
        stream's records whose problem is in that split, in stream order (disjoint problem sets).
        """
        if num_records < 1:
            raise ValueError(f"num_records must be >= 1; got {num_records}")
        if split not in ("all", "train", "test"):
            raise ValueError(f"split must be 'all', 'train' or 'test'; got {split!r}")
        if split == "all":
            return [self.record(seed, i) for i in range(num_records)]
        if self.test_fraction == 0:
            raise ValueError(f"split={split!r} needs a task with test_fraction > 0 (this one has no split)")
        share = self.test_fraction if split == "test" else 1.0 - self.test_fraction
        limit = int(50 * num_records / share) + 1000  # far past the expected stream length
        records: list[dict[str, str]] = []
        for index in range(limit):
            record = self.record(seed, index)
            if self.split_of(record["problem"]) == split:
                records.append(record)
                if len(records) == num_records:
                    return records
        raise ValueError(f"the {split!r} split has fewer than {num_records} problems in the first {limit} "
                         f"of stream {seed} (found {len(records)}): the task has too few distinct problems")

    def max_response_tokens(self) -> int:
        """An upper bound on the characters of a reference response (EOS not counted), so a floor for
        the sampler's max_new_tokens: |answer| <= largest**k with `*` (else k * largest), plus a sign;
        with `scratchpad`, k - 1 steps "total op operand=total" of at most that width each."""
        largest, k = 10**self.num_digits - 1, self.num_operands
        bound = largest**k if "*" in self.operations else k * largest
        sign = 1 if "-" in self.operations else 0
        width = len(str(bound)) + sign
        boxed = len(self.reference_response("9" * width, "0+0=" if self.scratchpad else None))
        if not self.scratchpad:
            return boxed
        step = width + 1 + self.num_digits + 1 + width + 1  # "total op operand=total "
        return (k - 1) * step + len(f"{BOXED_OPEN}{'9' * width}}}")


_TERM = re.compile(r"([+-]?)(\d+)")


def scratchpad_steps(problem: str) -> list[str]:
    """The left-to-right steps of a `+`/`-` problem: "12+34-5=" -> ["12+34=46", "46-5=41"]."""
    problem = problem.lstrip(" ")  # an aligned problem's padding
    if not re.fullmatch(r"\d+([+-]\d+)+=", problem):
        raise ValueError(f"expected a '+'/'-' problem like '12+34-5='; got {problem!r}")
    terms = _TERM.findall(problem[:-1])
    total = int(terms[0][1])
    steps = []
    for op, digits in terms[1:]:
        new = total + int(digits) if op == "+" else total - int(digits)
        steps.append(f"{total}{op}{digits}={new}")
        total = new
    return steps


DIFFICULTIES: dict[str, ArithmeticTask] = {
    "easy": ArithmeticTask(num_digits=1, num_operands=2, operations="+"),
    "medium": ArithmeticTask(num_digits=2, num_operands=2, operations="+-"),
    "hard": ArithmeticTask(num_digits=2, num_operands=3, operations="+-*"),
    # Multi-step work shown before the box (responses of 16-46 tokens, longer for more operands) and a
    # disjoint held-out split: the gradient-starvation study (experiments/gradient_starvation.py).
    "scratchpad": ArithmeticTask(num_digits=1, num_operands=6, min_operands=2, operations="+-",
                                 boxed_prefix=False, scratchpad=True, test_fraction=0.1, align=True),
    # The same with 12-16 operands: responses of ~85-160 tokens (~115 on average), the second study's
    # long-response regime, where a sequence's log W sums over many more tokens.
    "scratchpad_long": ArithmeticTask(num_digits=1, num_operands=16, min_operands=12, operations="+-",
                                      boxed_prefix=False, scratchpad=True, test_fraction=0.1, align=True),
    # 2-16 operands in one stream: short problems the base model mostly solves beside long ones (12-16
    # operands, responses of up to ~160 tokens) whose rare, long positives carry large |A|.
    "scratchpad_mixed": ArithmeticTask(num_digits=1, num_operands=16, min_operands=2, operations="+-",
                                       boxed_prefix=False, scratchpad=True, test_fraction=0.1, align=True),
}


def operand_count(problem: str) -> int:
    """The number of operands of a problem text: "12+34-5=" -> 3 (an aligned problem's padding ignored)."""
    return len(_TERM.findall(problem.strip(" ").rstrip("=")))


def get_task(difficulty: str, **overrides: Any) -> ArithmeticTask:
    """The named difficulty level of `DIFFICULTIES`, with `ArithmeticTask` fields replaced by `overrides`
    (e.g. `num_operands=5`); an unknown field raises TypeError, a bad value ValueError."""
    if difficulty not in DIFFICULTIES:
        raise KeyError(f"unknown difficulty {difficulty!r}; known: {', '.join(DIFFICULTIES)}")
    fields = {field.name for field in dataclasses.fields(ArithmeticTask)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown ArithmeticTask fields {unknown}; known: {sorted(fields)}")
    return dataclasses.replace(DIFFICULTIES[difficulty], **overrides) if overrides else DIFFICULTIES[difficulty]
