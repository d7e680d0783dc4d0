"""Prompt batches for the trainer: deterministic shuffling by seed, epochs, and a resumable position.

Built on grain's random-access `MapDataset`: the source is shuffled with a fresh permutation per epoch
(grain seeds epoch e with hash(seed) + e), cut into batches within each epoch (the last partial batch
of an epoch is dropped, so a batch never holds one problem twice), and repeated. Batch `step` is therefore a
pure function of (source, seed, batch_size, step); the whole iterator state is the step counter,
which a checkpoint stores as a small dict (`get_state`/`set_state`) and resumes exactly.

The source is any random-access sequence of records: a list from `records.load_*` or
`synthetic.ArithmeticTask.make_records`, or a `tfds.data_source` (its bytes are decoded to str).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import grain


def _grain_seed(seed: int) -> int:
    """grain shuffles epoch e with seed + e, so seeds s and s + 1 would share permutations one epoch
    apart; hashing the user's seed first makes different seeds give unrelated epoch orders."""
    return int.from_bytes(hashlib.sha256(f"prompt-batches:{seed}".encode()).digest()[:4], "little")


def _as_text_record(record: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in record.items()}


class PromptBatches:
    """An iterator of batches (lists of `batch_size` record dicts) over `num_epochs` epochs (None: forever).

    `batches_per_epoch = len(source) // batch_size`. State: {"step", "seed", "batch_size",
    "num_records"}; `set_state` refuses a state written for another seed, batch size or source length,
    since resuming it would silently change the data order.
    """

    def __init__(
        self, source: Sequence[Mapping[str, Any]], batch_size: int, seed: int, num_epochs: int | None = None
    ):
        num_records = len(source)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if num_records < batch_size:
            raise ValueError(f"the source has {num_records} records, fewer than one batch of {batch_size}")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must lie in [0, 2**32); got {seed}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None; got {num_epochs}")
        self.seed, self.batch_size = seed, batch_size
        self.num_records, self.num_epochs = num_records, num_epochs
        dataset = (
            grain.MapDataset.source(source)
            .shuffle(seed=_grain_seed(seed))
            .map(_as_text_record)
            .batch(batch_size, drop_remainder=True, batch_fn=list)
        )
        self._dataset = dataset.repeat(num_epochs)
        self.batches_per_epoch = len(dataset)
        self.step = 0

    def __len__(self) -> int:
        """Batches in total (num_epochs * batches_per_epoch); only defined for a finite run."""
        if self.num_epochs is None:
            raise TypeError("an endless PromptBatches (num_epochs=None) has no length")
        return self.num_epochs * self.batches_per_epoch

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.step // self.batches_per_epoch

    def batch_at(self, step: int) -> list[dict[str, Any]]:
        """Batch number `step` (0-based), without moving the iterator."""
        if step < 0 or (self.num_epochs is not None and step >= len(self)):
            raise IndexError(f"step {step} is outside [0, {len(self) if self.num_epochs else 'inf'})")
        return self._dataset[step]

    def __iter__(self) -> "PromptBatches":
        return self

    def __next__(self) -> list[dict[str, Any]]:
        if self.num_epochs is not None and self.step >= len(self):
            raise StopIteration
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {
            "step": self.step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_records": self.num_records,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        expected = {"seed": self.seed, "batch_size": self.batch_size, "num_records": self.num_records}
        missing = [k for k in ("step", *expected) if k not in state]
        if missing:
            raise KeyError(f"batch state lacks {missing}; got keys {sorted(state)}")
        mismatched = {k: (int(state[k]), v) for k, v in expected.items() if int(state[k]) != v}
        if mismatched:
            raise ValueError(
                "batch state was written for another data setup (saved, current): "
                + ", ".join(f"{k}={a} vs {b}" for k, (a, b) in mismatched.items())
            )
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"batch state step must be >= 0; got {step}")
        self.step = step
