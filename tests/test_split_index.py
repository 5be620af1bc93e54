"""pipeline.index alone: plan items -> (sample, unit), and a batch's items grouped into samples."""

from __future__ import annotations

import numpy as np

from pipeline.index import SplitIndex, group, locate

# Two shards: samples of 2 and 1 units, then of 1 and 3 units.
UNITS = [[2, 1], [1, 3]]
STARTS = {0: np.array([0, 2]), 1: np.array([0, 1])}


def _index(by_units: bool) -> SplitIndex:
    sizes = np.array([sum(u) if by_units else len(u) for u in UNITS])
    counts = np.array([len(u) for u in UNITS])
    return SplitIndex("root", None, by_units, sizes, np.concatenate(([0], np.cumsum(counts))),  # type: ignore[arg-type]
                      np.concatenate(([0], np.cumsum(sizes))))


def test_locate_maps_units_to_samples_across_shards():
    samples, units = locate(_index(True), np.arange(7), STARTS)
    assert samples.tolist() == [0, 0, 1, 2, 3, 3, 3]
    assert units.tolist() == [0, 1, 0, 0, 0, 1, 2]
    samples, units = locate(_index(True), np.array([6, 0, 4]), STARTS)  # any order, any subset
    assert samples.tolist() == [3, 0, 3] and units.tolist() == [2, 0, 0]


def test_locate_by_samples_needs_no_shard_index():
    index = _index(False)
    samples, units = locate(index, np.array([3, 1, 2]), {})
    assert samples.tolist() == [3, 1, 2] and units.tolist() == [0, 0, 0]
    assert index.where(3) == (1, 1) and index.shards_of(np.array([0, 2, 3])).tolist() == [0, 1, 1]


def test_group_keeps_plan_order_or_gathers_each_samples_units():
    sources, samples, units = np.array([0, 0, 0, 0]), np.array([3, 0, 3, 1]), np.array([0, 0, 1, 0])
    wheres, work = group(sources, samples, units, grouped=False)
    assert wheres == [(0, 3), (0, 0), (0, 1)]
    assert work == [((0, 3), 0), ((0, 0), 0), ((0, 3), 1), ((0, 1), 0)]
    wheres, work = group(sources, samples, units, grouped=True)
    assert wheres == [(0, 3), (0, 0), (0, 1)]
    assert [(where, unit.tolist()) for where, unit in work] == [((0, 3), [0, 1]), ((0, 0), [0]), ((0, 1), [0])]


def test_group_tells_sources_apart():
    wheres, work = group(np.array([1, 0, 1, 1]), np.array([5, 5, 6, 5]), np.array([0, 0, 0, 1]), grouped=True)
    assert wheres == [(1, 5), (0, 5), (1, 6)]
    assert [u.tolist() for _, u in work] == [[0, 1], [0], [0]]
