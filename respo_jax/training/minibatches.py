"""How a rollout batch of N·M·G responses is split into the N mini-batches of its policy updates (§4.1).

"consecutive" is the paper's split: rows stay prompt-major and mini-batch k holds prompts [kM, (k+1)M).
"balanced" reproduces verl's ``trainer.balance_batch`` (``RayPPOTrainer._balance_batch``), which reorders
the rollout batch before the actor splits it, so a reproduction of a verl run sees the same mini-batches:

  1. workload of each response: 24576 L + L^2 with L = prompt + response tokens
     (``verl.utils.seqlen_balancing.calculate_workload``);
  2. the rows are partitioned into D equal-size sets of near-equal total workload with the
     Karmarkar-Karp largest-differencing method (``get_seqlen_balanced_partitions``, equal_size=True),
     D = the data-parallel ranks;
  3. each set is sorted by (workload, row) and laid out small at both ends: even positions ascending,
     then odd positions descending;
  4. rank r receives set r and splits it into N consecutive local mini-batches, so global mini-batch k
     is the union over ranks of slice k of each set.

Everything here is a pure function of host arrays.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def consecutive_minibatches(num_rows: int, num_minibatches: int) -> list[np.ndarray]:
    """Row indices of N consecutive mini-batches: [k rows/N, (k+1) rows/N)."""
    if num_minibatches < 1 or num_rows % num_minibatches:
        raise ValueError(f"{num_rows} rows cannot be split into {num_minibatches} equal mini-batches")
    size = num_rows // num_minibatches
    return [np.arange(k * size, (k + 1) * size) for k in range(num_minibatches)]


def sequence_workload(sequence_lengths) -> np.ndarray:
    """verl's attention-aware workload estimate 24576 L + L^2 (a 7B-calibrated FLOP proxy), int64."""
    lengths = np.asarray(sequence_lengths, np.int64)
    return 24576 * lengths + lengths**2


class _Subset:
    """One part of a partition: its (row, value) items in insertion order and their sum."""

    def __init__(self, items: list[tuple[int, int]]):
        self.items = list(items)
        self.total = sum(value for _, value in items)

    def key(self):
        return (self.total, len(self.items), self.items)

    def absorb(self, other: "_Subset") -> None:
        self.items.extend(other.items)
        self.total += other.total


class _PartialPartition:
    """k subsets kept in decreasing order; the heap pops the largest spread first (ties: the largest
    leading subset), which is the largest-differencing rule."""

    def __init__(self, subsets: list[_Subset]):
        self.subsets = sorted(subsets, key=_Subset.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.subsets[0].total - self.subsets[-1].total

    def __lt__(self, other: "_PartialPartition") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.subsets[0].key() > other.subsets[0].key()

    def combine(self, other: "_PartialPartition") -> None:
        """Pairs this partition's largest subset with the other's smallest, and so on."""
        k = len(self.subsets)
        for i in range(k):
            self.subsets[i].absorb(other.subsets[k - 1 - i])
        self.subsets.sort(key=_Subset.key, reverse=True)


def equal_size_partitions(values: Sequence[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp (largest differencing) partition of row indices into k sets of len(values)/k rows
    each with near-equal sums; each set's indices sorted ascending."""
    values = [int(v) for v in values]
    n = len(values)
    if k < 1 or n < k or n % k:
        raise ValueError(f"{n} rows cannot be partitioned into {k} equal-size sets")
    ranked = sorted((value, row) for row, value in enumerate(values))
    heap: list[_PartialPartition] = []
    for start in range(0, n, k):  # k consecutive ranks form one k-way seed partition
        chunk = ranked[start : start + k]
        heapq.heappush(heap, _PartialPartition([_Subset([(row, value)]) for value, row in chunk]))
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        first.combine(second)
        heapq.heappush(heap, first)
    return [sorted(row for row, _ in subset.items) for subset in heap[0].subsets]


def _small_at_both_ends(rows: list[int], workload: np.ndarray) -> list[int]:
    ordered = sorted(rows, key=lambda row: (int(workload[row]), row))
    return ordered[::2] + ordered[1::2][::-1]


def balanced_minibatches(
    sequence_lengths, num_minibatches: int, num_ranks: int = 1
) -> list[np.ndarray]:
    """Row indices of the N mini-batches verl's length-balanced reordering produces for responses of
    ``sequence_lengths: [rows]`` (prompt + response tokens) on ``num_ranks`` data-parallel ranks."""
    workload = sequence_workload(sequence_lengths)
    rows = workload.shape[0]
    if num_minibatches < 1 or num_ranks < 1 or rows % (num_minibatches * num_ranks):
        raise ValueError(
            f"{rows} rows cannot be split into {num_minibatches} mini-batches over {num_ranks} ranks"
        )
    parts = [_small_at_both_ends(p, workload) for p in equal_size_partitions(workload.tolist(), num_ranks)]
    per_rank = rows // (num_minibatches * num_ranks)
    return [
        np.array([row for part in parts for row in part[k * per_rank : (k + 1) * per_rank]], np.int64)
        for k in range(num_minibatches)
    ]


def minibatch_rows(
    order: str, sequence_lengths, num_minibatches: int, num_ranks: int = 1
) -> list[np.ndarray]:
    """The mini-batches of ``order`` ("consecutive" or "balanced") for a rollout batch."""
    if order == "consecutive":
        return consecutive_minibatches(len(sequence_lengths), num_minibatches)
    if order == "balanced":
        return balanced_minibatches(sequence_lengths, num_minibatches, num_ranks)
    raise ValueError(f"unknown mini-batch order {order!r}; expected 'consecutive' or 'balanced'")
