"""Seed purposes: the one table of the words that keep each random draw's stream apart.

Every draw seeds `numpy.random.default_rng` with explicit entropy that starts (seed, epoch) and
then names its purpose, so no two uses share a stream by accident. The numbers are part of every
order and mask choice (changing one changes them); a new use takes a new number here.

    (seed, epoch, [source, pass,] SHARD_ORDER)            the shard permutation of a source (plan.shuffle)
    (seed, epoch, [source, pass,] WINDOW_ORDER, window)   a shuffle window's permutation (plan.shuffle)
    (seed, epoch, MASKS, key's blake2b-128)               the masks an SA-1B sample uses (kinds.sa1b)
    (seed, epoch, MIX_ORDER, MixStep.LABELS, window)      a mixing window's permutation (plan.mixing)
    (seed, epoch, MIX_ORDER, MixStep.SPLIT, lo, hi)       a mixing tree node's split (plan.mixing)
    (seed, epoch, MASK_REPEATS, key's blake2b-128)        the repeats that fill an SA-1B sample's masks (fill_masks)
    (seed, epoch, POINTS, key's blake2b-128)              the point prompts drawn in an SA-1B sample's masks
    (seed, epoch, BOX_NOISE, key's blake2b-128)           the noise of an SA-1B sample's box prompts
    (seed, epoch, HFLIP, key's blake2b-128)               whether an SA-1B sample is mirrored (hflip)
    (seed, epoch, SCALE_JITTER, key's blake2b-128)        an SA-1B sample's scale (scale_jitter)
    (seed, epoch, CROP, key's blake2b-128)                an SA-1B sample's crop offset (scale_jitter)

Each of an SA-1B sample's draws has a stream of its own: turning one option on or off changes no
other draw (the points of a mask stay the same with or without box noise, and so on).

A mixed epoch's per-source orders put (source, pass) where the purpose goes: source 4's first
pass seeds its shard permutation as mixing window 1's labels are seeded. Kept: fixing it would
change every mixed order with five sources or more.
"""

from __future__ import annotations

import enum
import hashlib

import numpy as np

__all__ = ["Purpose", "MixStep", "key_entropy", "sample_rng"]


@enum.unique
class Purpose(enum.IntEnum):
    """The word after (seed, epoch) that says what a draw is for."""

    SHARD_ORDER = 1
    WINDOW_ORDER = 2
    MASKS = 3
    MIX_ORDER = 4
    MASK_REPEATS = 5
    POINTS = 6
    BOX_NOISE = 7
    HFLIP = 8
    SCALE_JITTER = 9
    CROP = 10
    BLOCK_ORDER = 11


@enum.unique
class MixStep(enum.IntEnum):
    """Within `Purpose.MIX_ORDER`: which part of the mixed order a draw decides."""

    LABELS = 0  # a window's permutation of its sources' labels
    SPLIT = 1  # a tree node's split of its per-source counts between its halves


def key_entropy(key: str) -> int:
    """A sample key as entropy: its blake2b-128, little-endian (never `hash()`: it differs per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "little")


def sample_rng(seed: int, epoch: int, purpose: Purpose, entropy: int) -> np.random.Generator:
    """The stream of one per-sample draw: (seed, epoch, purpose, `key_entropy(key)`)."""
    return np.random.default_rng([seed, epoch, purpose, entropy])
