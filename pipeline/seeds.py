"""Seed purposes: the one table of the words that keep each random draw's stream apart.

Every draw seeds `numpy.random.default_rng` with explicit entropy that starts (seed, epoch) and
then names its purpose, so no two uses share a stream by accident. The numbers are part of every
order and mask choice (changing one changes them); a new use takes a new number here.

    (seed, epoch, [source, pass,] SHARD_ORDER)            the shard permutation of a source (plan.shuffle)
    (seed, epoch, [source, pass,] WINDOW_ORDER, window)   a shuffle window's permutation (plan.shuffle)
    (seed, epoch, MASKS, key's blake2b-128)               the masks an SA-1B sample uses (kinds.sa1b)
    (seed, epoch, MIX_ORDER, MixStep.LABELS, window)      a mixing window's permutation (plan.mixing)
    (seed, epoch, MIX_ORDER, MixStep.SPLIT, lo, hi)       a mixing tree node's split (plan.mixing)

A mixed epoch's per-source orders put (source, pass) where the purpose goes: source 4's first
pass seeds its shard permutation as mixing window 1's labels are seeded. Kept: fixing it would
change every mixed order with five sources or more.
"""

from __future__ import annotations

import enum

__all__ = ["Purpose", "MixStep"]


@enum.unique
class Purpose(enum.IntEnum):
    """The word after (seed, epoch) that says what a draw is for."""

    SHARD_ORDER = 1
    WINDOW_ORDER = 2
    MASKS = 3
    MIX_ORDER = 4


@enum.unique
class MixStep(enum.IntEnum):
    """Within `Purpose.MIX_ORDER`: which part of the mixed order a draw decides."""

    LABELS = 0  # a window's permutation of its sources' labels
    SPLIT = 1  # a tree node's split of its per-source counts between its halves
