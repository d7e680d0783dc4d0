"""A synthetic verifiable task and an in-process character tokenizer, for CPU-scale ReSPO runs.

The paper trains on DAPO-Math with a strict-box reward (App. D.1); at CPU scale the same loop runs on
small arithmetic whose answer is written in `\\boxed{}` and scored by the same verifier, with no
download. Problems are `"3+4="`, answers exact integer strings (`"7"`).

Response format. By default (`boxed_prefix=True`) the prompt already ends with `\\boxed{` (the
`PromptFormat.response_prefix`), so the model only writes `7}` and EOS: two tokens plus EOS on the
easy level, which a tiny model reaches by chance often enough for RL to get a signal. The reward must
score `task.prompt_format.solution_text(response)` (`"\\boxed{" + response`). With
`boxed_prefix=False` the model writes `\\boxed{7}` itself.

Difficulty knobs: digits per operand, number of operands, operation mix (`+`, `-`, `*`, usual
precedence). Longer answers mean longer responses, so length effects and rollout reuse show;
`DIFFICULTIES` holds the named levels. Records are a pure function of (seed, index), independent of
NumPy versions: each draw hashes `seed:index:draw` with SHA-256.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    num_operands: operands per problem (>= 2).
    operations: the operation mix, drawn uniformly per slot, e.g. "+", "+-", "+-*".
    boxed_prefix: the prompt ends with `\\boxed{` (see module doc).
    """

    num_digits: int = 1
    num_operands: int = 2
    operations: str = "+"
    boxed_prefix: bool = True

    def __post_init__(self):
        if self.num_digits < 1 or self.num_operands < 2:
            raise ValueError(
                f"need num_digits >= 1 and num_operands >= 2; got {self.num_digits}, {self.num_operands}"
            )
        if (
            not self.operations
            or set(self.operations) - set("+-*")
            or len(set(self.operations)) != len(self.operations)
        ):
            raise ValueError(f"operations must be distinct characters from '+-*'; got {self.operations!r}")

    @property
    def prompt_format(self) -> PromptFormat:
        """Raw prompt = problem (+ `\\boxed{` when boxed_prefix); score `solution_text(response)`."""
        return PromptFormat(
            template="{problem}", chat=False, response_prefix=BOXED_OPEN if self.boxed_prefix else ""
        )

    def reference_response(self, answer: str) -> str:
        """The shortest correct response text (without EOS), e.g. for a supervised warm-up."""
        return f"{answer}}}" if self.boxed_prefix else f"{BOXED_OPEN}{answer}}}"

    def record(self, seed: int, index: int) -> dict[str, str]:
        """Problem `index` of the stream `seed`: {"problem": "3+4=", "answer": "7", "id": "seed-index"}."""
        operands = [_draw(seed, index, k, 10**self.num_digits) for k in range(self.num_operands)]
        ops = [
            self.operations[_draw(seed, index, self.num_operands + k, len(self.operations))]
            for k in range(self.num_operands - 1)
        ]
        problem = str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:])) + "="
        return {"problem": problem, "answer": str(evaluate(operands, ops)), "id": f"{seed}-{index}"}

    def make_records(self, num_records: int, seed: int) -> list[dict[str, str]]:
        """`num_records` problems, deterministic in `seed` (record i is `record(seed, i)`)."""
        if num_records < 1:
            raise ValueError(f"num_records must be >= 1; got {num_records}")
        return [self.record(seed, i) for i in range(num_records)]

    def max_response_tokens(self) -> int:
        """An upper bound on the characters of a reference response (EOS not counted), so a floor for
        the sampler's max_new_tokens: |answer| <= largest**k with `*` (else k * largest), plus a sign."""
        largest, k = 10**self.num_digits - 1, self.num_operands
        bound = largest**k if "*" in self.operations else k * largest
        sign = 1 if "-" in self.operations else 0
        return len(self.reference_response("9" * (len(str(bound)) + sign)))


DIFFICULTIES: dict[str, ArithmeticTask] = {
    "easy": ArithmeticTask(num_digits=1, num_operands=2, operations="+"),
    "medium": ArithmeticTask(num_digits=2, num_operands=2, operations="+-"),
    "hard": ArithmeticTask(num_digits=2, num_operands=3, operations="+-*"),
}


def get_task(difficulty: str) -> ArithmeticTask:
    """The named difficulty level of `DIFFICULTIES`."""
    if difficulty not in DIFFICULTIES:
        raise KeyError(f"unknown difficulty {difficulty!r}; known: {', '.join(DIFFICULTIES)}")
    return DIFFICULTIES[difficulty]
