"""Which examples each process trains on at each optimizer step: one order per epoch, split without overlap.

An optimizer step takes the next ``global_batch`` examples of the epoch's order (``batch_size`` x gradient
accumulation x processes; the last step of an epoch takes what is left). Process r of N takes every N-th of them
from the r-th, in micro-batches of ``batch_size``. The order depends on the seed and the epoch only, so every
process agrees on it, a resumed run finds the same steps, and N processes of batch b train on exactly the
examples one process of batch N x b does, step by step. A process left with nothing in a short last step trains
on a weightless copy (loss mask 0) of one of the step's examples, so that every process takes part in each step's
gradient exchange without any example counting twice.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=2)  # asked once per optimizer step: the shuffle itself once per epoch
def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The examples' order in ``epoch`` (a seeded shuffle; the same on every process)."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def steps_per_epoch(count: int, global_batch: int) -> int:
    """Optimizer steps in one epoch of ``count`` examples (the last one may be short)."""
    return math.ceil(count / global_batch)


def step_examples(order: list[int], step: int, global_batch: int) -> list[int]:
    """The examples of optimizer step ``step`` (0-based, within the epoch)."""
    return order[step * global_batch:(step + 1) * global_batch]


def rank_micro_batches(examples: list[int], micro: int, rank: int, world: int) -> list[list[int]]:
    """Process ``rank``'s share of one step's ``examples`` in micro-batches of at most ``micro``, as many on every
    process: a shorter share ends on empty ones."""
    mine = examples[rank::world]
    count = math.ceil(math.ceil(len(examples) / world) / micro)
    return [mine[i * micro:(i + 1) * micro] for i in range(count)]
