"""pipeline.plan: exactly-once, equal per-rank batch counts, determinism, for every world."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.plan import (
    Mix, PlanError, Resume, World, epoch_order, mixed_order, plan_epoch, rank_batch_count, rank_batch_sizes,
    rank_positions, rank_sample_count, SHUFFLES, get_shuffle, shuffle_name,
)
from pipeline.plan.shuffle import BLOCK

SIZES = {
    "fewer shards than workers": [9],
    "uneven with empty shard": [5, 0, 7, 3, 1],
    "many small": [2] * 13,
    "tiny": [3, 2],
}


def _reference_batch_sizes(total, world_size, rank, batch_size, drop_last):
    """(first position, batch sizes) of `rank`'s span, dealt by the partition's rules (its docstring):
    contiguous spans in rank order; drop_last: every rank total // (world_size * batch_size) full
    batches; else the first total % world_size ranks one sample more, each rank as many batches as the
    largest needs, and a rank whose last batch would be empty lends it one sample of the one before
    (which batches of 1, or no batch before it, cannot: PlanError)."""
    if drop_last:
        full = total // (world_size * batch_size)
        return rank * full * batch_size, [batch_size] * full
    counts = [total // world_size + (r < total % world_size) for r in range(world_size)]
    sizes, left = [], counts[rank]
    for _ in range(-(-max(counts) // batch_size)):
        sizes.append(min(batch_size, left))
        left -= sizes[-1]
    if sizes and sizes[-1] == 0:
        if len(sizes) < 2 or batch_size < 2:
            raise PlanError(f"rank {rank} of {world_size}: {counts[rank]} samples in {len(sizes)} batches")
        sizes[-2:] = [batch_size - 1, 1]
    return sum(counts[:rank]), sizes


def _splits(total, world_size, batch_size, drop_last):
    """Whether every rank of the world can have its batches (`_reference_batch_sizes`)."""
    try:
        for rank in range(world_size):
            _reference_batch_sizes(total, world_size, rank, batch_size, drop_last)
    except PlanError:
        return False
    return True


def _epoch(sizes, world_size, workers, *, batch_size, drop_last, shuffle, seed=3, epoch=1, window=4):
    """Per rank: the batches in the order the DataLoader yields them (round-robin over workers)."""
    ranks = []
    for rank in range(world_size):
        per_worker = [
            [(b, ids) for b, _, ids in plan_epoch([sizes], seed, epoch, World(rank, world_size, w, max(workers, 1)),
                                                   batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, window=window)]
            for w in range(max(workers, 1))
        ]
        merged = sorted((b for plan in per_worker for b in plan), key=lambda b: b[0])
        assert [b for b, _ in merged] == list(range(len(merged)))
        # round-robin over workers gives the same order
        rr = [b for group in itertools.zip_longest(*per_worker) for b in group if b is not None]
        assert [b for b, _ in rr] == [b for b, _ in merged]
        ranks.append([ids for _, ids in merged])
    return ranks


@pytest.mark.parametrize("name", SIZES)
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_exactly_once_for_every_world(name, drop_last, shuffle):
    sizes = SIZES[name]
    total = sum(sizes)
    for world_size, workers, batch_size in itertools.product(range(1, 9), range(5), (1, 2, 3, 4)):
        kw = dict(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle)
        if not _splits(total, world_size, batch_size, drop_last):
            # (drop_last=False with batch_size 1 and an uneven split, or fewer samples than ranks)
            with pytest.raises(PlanError, match="use drop_last=True"):
                _epoch(sizes, world_size, workers, **kw)
            continue
        ranks = _epoch(sizes, world_size, workers, **kw)
        counts = {len(r) for r in ranks}
        assert len(counts) == 1, "every rank yields the same number of batches"
        ids = np.concatenate([b for r in ranks for b in r]) if counts != {0} else np.zeros(0, int)
        assert len(ids) == len(set(ids.tolist())), "no sample twice"
        assert set(ids.tolist()) <= set(range(total))
        assert all(0 < len(b) <= batch_size for r in ranks for b in r)
        if drop_last:
            assert all(len(b) == batch_size for r in ranks for b in r)
            assert total - len(ids) < world_size * batch_size, "only the remainder is dropped"
        else:
            assert sorted(ids.tolist()) == list(range(total)), "every sample exactly once"
            # full batches except at most the last two of a rank
            assert all(len(b) == batch_size for r in ranks for b in r[:-2])


def test_rank_batch_sizes_and_counts_are_the_dealt_ones():
    """Every rank of every small world: its span and batch sizes, counts and plan, against the batches
    dealt by the partition's rules (`_reference_batch_sizes`), or PlanError where a rank cannot have them."""
    for total, world_size, batch_size, drop_last in itertools.product(range(0, 40), range(1, 6), range(1, 6), (True, False)):
        for rank in range(world_size):
            args = (total, world_size, rank, batch_size, drop_last)
            try:
                start, sizes = _reference_batch_sizes(*args)
            except PlanError:
                for count in (rank_batch_sizes, rank_batch_count, rank_sample_count):
                    with pytest.raises(PlanError, match="use drop_last=True"):
                        count(*args)
                continue
            assert rank_batch_sizes(*args) == (start, sizes), args
            assert (rank_batch_count(*args), rank_sample_count(*args)) == (len(sizes), sum(sizes)), args
            plan = plan_epoch([[total]], 0, 0, World(rank, world_size), batch_size=batch_size, drop_last=drop_last,
                              shuffle=False)
            assert [ids.tolist() for _, _, ids in plan] == \
                [list(range(start + sum(sizes[:i]), start + sum(sizes[: i + 1]))) for i in range(len(sizes))], args


def test_shuffle_is_deterministic_and_changes_with_epoch_and_seed():
    sizes = [50, 30, 20]
    order = lambda seed, epoch: epoch_order(sizes, [seed, epoch], True, 16, np.arange(100)).tolist()  # noqa: E731
    assert order(0, 0) == order(0, 0)
    assert sorted(order(0, 0)) == list(range(100))
    assert order(0, 0) != order(0, 1) != order(0, 2)
    assert order(0, 0) != order(1, 0)
    assert epoch_order(sizes, [0, 0], False, 16, np.arange(10, 20)).tolist() == list(range(10, 20))


def test_shuffle_window_keeps_locality():
    """Within a window the samples come from few shards: consecutive windows of the shard sequence."""
    sizes = [10] * 10
    ids = epoch_order(sizes, [0, 0], True, 10, np.arange(100))
    for w in range(10):
        shards = set((ids[w * 10 : (w + 1) * 10] // 10).tolist())
        assert len(shards) <= 2


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=8), window=st.integers(1, 50),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 1000), data=st.data())
def test_order_is_a_permutation_and_slices_agree(sizes, window, seed, epoch, data):
    total = sum(sizes)
    whole = epoch_order(sizes, [seed, epoch], True, window, np.arange(total))
    assert sorted(whole.tolist()) == list(range(total))
    picked = np.array(data.draw(st.lists(st.integers(0, max(total - 1, 0)), max_size=total)) if total else [], dtype=np.int64)
    np.testing.assert_array_equal(epoch_order(sizes, [seed, epoch], True, window, picked), whole[picked])


def test_invalid_arguments():
    with pytest.raises(ValueError, match="rank"):
        World(2, 2)
    with pytest.raises(ValueError, match="worker"):
        World(0, 1, 1, 1)
    with pytest.raises(ValueError, match="seed"):
        plan_epoch([[3]], -1, 0, World(), batch_size=1)
    with pytest.raises(PlanError, match="drop_last=True"):
        rank_batch_sizes(3, 4, 3, 2, drop_last=False)


def _rank_runs(total, world_size, batch_size, drop_last, history=()):
    return [rank_positions(total, world_size, r, batch_size, drop_last, history) for r in range(world_size)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_resuming_in_the_same_world_continues_each_rank(drop_last):
    for total, world_size, batch_size in itertools.product((7, 20, 33), (1, 2, 3), (1, 2, 4)):
        if not _splits(total, world_size, batch_size, drop_last):
            with pytest.raises(PlanError, match="use drop_last=True"):
                _rank_runs(total, world_size, batch_size, drop_last)
            continue
        full = _rank_runs(total, world_size, batch_size, drop_last)
        for k in range(len(full[0]) + 1):
            resumed = _rank_runs(total, world_size, batch_size, drop_last, (Resume(world_size, k),))
            for r in range(world_size):
                assert [b.tolist() for b in resumed[r]] == [b.tolist() for b in full[r][k:]]
        with pytest.raises(PlanError, match="cannot resume"):
            _rank_runs(total, world_size, batch_size, drop_last, (Resume(world_size, len(full[0]) + 1),))


@pytest.mark.parametrize("drop_last", [True, False])
def test_elastic_resumption_takes_every_sample_once(drop_last):
    """Stop after k batches in one world, finish in another (and another): nothing twice, nothing lost."""
    for total, batch_size in itertools.product((23, 40), (2, 3)):
        for worlds in [(2, 1), (1, 2), (2, 3), (3, 2, 1), (1, 4)]:
            if not _splits(total, worlds[0], batch_size, drop_last):
                with pytest.raises(PlanError, match="use drop_last=True"):
                    _rank_runs(total, worlds[0], batch_size, drop_last)
                continue
            first = _rank_runs(total, worlds[0], batch_size, drop_last)
            for k in range(len(first[0]) + 1):
                history, seen, ok = [], [], True
                for i, world_size in enumerate(worlds):
                    if not _splits(total - len(seen), world_size, batch_size, drop_last):  # (what no rank took)
                        with pytest.raises(PlanError, match="use drop_last=True"):
                            _rank_runs(total, world_size, batch_size, drop_last, tuple(history))
                        ok = False
                        break
                    runs = _rank_runs(total, world_size, batch_size, drop_last, tuple(history))
                    assert len({len(r) for r in runs}) == 1, "equal batch counts in every world"
                    take = k if i < len(worlds) - 1 else len(runs[0])
                    take = min(take, len(runs[0]))
                    seen += [p for r in runs for b in r[:take] for p in b.tolist()]
                    history.append(Resume(world_size, take))
                if not ok:
                    continue
                assert len(seen) == len(set(seen)), (worlds, k)
                if drop_last:
                    assert total - len(seen) < worlds[-1] * batch_size, "only the last split drops"
                else:
                    assert sorted(seen) == list(range(total)), (worlds, k)


def test_mix_shares_are_exact_and_deterministic():
    sources = [[3000] * 4, [2500] * 2, [700]]
    mix = Mix.of([12000, 5000, 700], [0.7, 0.25, 0.05], None)
    total = sum(mix.counts)
    assert total == 14000, "the most that exhausts no source: 700 / 0.05"
    for share, weight in zip(mix.counts, (0.7, 0.25, 0.05)):
        assert abs(share / total - weight) < 0.01 and abs(share - weight * total) <= 1
    source, ids = mixed_order(sources, mix, 1, 2, True, 512, np.arange(total))
    again = mixed_order(sources, mix, 1, 2, True, 512, np.arange(total))
    assert (source == again[0]).all() and (ids == again[1]).all()
    assert not (source == mixed_order(sources, mix, 1, 3, True, 512, np.arange(total))[0]).all(), "epochs differ"
    for s, share in enumerate(mix.counts):
        taken = ids[source == s]
        assert taken.size == share and len(set(taken.tolist())) == share, "once within the share"
    # every 10k-sample stretch is within 1 point of the weights
    for start in (0, total - 10000):
        part = source[start : start + 10000]
        for s, weight in enumerate((0.7, 0.25, 0.05)):
            assert abs((part == s).mean() - weight) < 0.01


def test_mix_cycles_a_small_source_and_concatenates_without_weights():
    mix = Mix.of([10, 100], [0.5, 0.5], epoch_size=60)
    assert mix.counts == (30, 30)
    source, ids = mixed_order([[10], [100]], mix, 0, 0, True, 8, np.arange(60))
    small = ids[source == 0]
    for run in range(3):  # three passes over the 10 samples, each a permutation
        assert sorted(small[run * 10 : (run + 1) * 10].tolist()) == list(range(10))
    assert Mix.of([5, 7], None, None).counts == (5, 7)
    source, ids = mixed_order([[5], [7]], Mix.of([5, 7], None, None), 0, 0, False, 8, np.arange(12))
    assert source.tolist() == [0] * 5 + [1] * 7 and ids.tolist() == list(range(5)) + list(range(7))
    with pytest.raises(ValueError, match="weights"):
        Mix.of([5, 7], [1.0], None)
    with pytest.raises(ValueError, match="epoch_size needs weights"):
        Mix.of([5, 7], None, 10)


def test_mixed_plan_splits_exactly_and_resumes():
    sources = [[40, 40], [30]]
    mix = Mix.of([80, 30], [0.6, 0.4], None)
    for world_size, workers in itertools.product((1, 2, 3), (1, 2)):
        seen = []
        for rank in range(world_size):
            for w in range(workers):
                plan = plan_epoch(sources, 4, 1, World(rank, world_size, w, workers), batch_size=2, mix=mix)
                seen += [(int(s), int(i)) for _, src, ids in plan for s, i in zip(src, ids)]
        assert len(seen) == len(set(seen)) and sum(mix.counts) - len(seen) < world_size * 2
    full = plan_epoch(sources, 4, 1, World(), batch_size=2, mix=mix)
    rest = plan_epoch(sources, 4, 1, World(), batch_size=2, mix=mix, history=(Resume(1, 5),))
    assert [(s.tolist(), i.tolist()) for _, s, i in rest] == [(s.tolist(), i.tolist()) for _, s, i in full[5:]]


# --- the lazy plan against the plan as it was computed before (whole-epoch arrays), on small sizes ---

def _reference_positions(total, world_size, rank, batch_size, drop_last, history=()):
    """Each batch's positions, the old way: the whole epoch's positions, set-differenced per stretch."""
    def split(positions, sizes):
        return np.split(positions[: sum(sizes)], np.cumsum(sizes)[:-1]) if sizes else []

    remaining = np.arange(total, dtype=np.int64)
    for i, stretch in enumerate(history):
        cut = []
        for r in range(stretch.world_size):
            start, sizes = _reference_batch_sizes(remaining.size, stretch.world_size, r, batch_size, drop_last)
            if stretch.batches > len(sizes):
                raise PlanError("cannot resume")
            cut.append(split(remaining[start:], sizes))
        if i == len(history) - 1 and stretch.world_size == world_size:
            return cut[rank][stretch.batches :]
        taken = [p for batches in cut for p in batches[: stretch.batches]]
        remaining = np.setdiff1d(remaining, np.concatenate(taken)) if taken else remaining
    start, sizes = _reference_batch_sizes(remaining.size, world_size, rank, batch_size, drop_last)
    return split(remaining[start:], sizes)


def _reference_plan(sources, seed, epoch, world, *, batch_size, drop_last, shuffle, window, mix=None, history=()):
    """A worker's plan, the old way: its rank's whole positions (`_reference_positions`), each worker's
    batches dealt round-robin, their ids from the order of the positions (`epoch_order`, `mixed_order`:
    the shuffles, each tested against its own laws and pinned orders above)."""
    total = sum(mix.counts) if mix is not None else sum(sources[0])
    mine = _reference_positions(total, world.world_size, world.rank, batch_size, drop_last, history)[world.worker :: world.num_workers]
    positions = np.concatenate(mine) if mine else np.zeros(0, np.int64)
    if mix is None:
        source, ids = np.zeros(positions.size, np.int64), epoch_order(sources[0], [seed, epoch], shuffle, window, positions)
    else:
        source, ids = mixed_order(sources, mix, seed, epoch, shuffle, window, positions)
    bounds = np.cumsum([0] + [len(b) for b in mine])
    return [(world.worker + i * world.num_workers, source[bounds[i] : bounds[i + 1]], ids[bounds[i] : bounds[i + 1]])
            for i in range(len(mine))]


def _items(plan):
    return [(b, s.tolist(), i.tolist()) for b, s, i in plan]


def test_single_source_order_is_pinned():
    """Saved resume states and trained runs depend on this order: it must not change."""
    assert epoch_order([5, 0, 7, 3, 1], [3, 1], True, 4, np.arange(16)).tolist() == [
        0, 12, 14, 13, 1, 4, 3, 2, 8, 5, 6, 7, 15, 10, 9, 11]
    assert epoch_order([1000] * 50, [7, 3], True, 16384, np.array([0, 1, 2, 16383, 16384, 49999])).tolist() == [
        2479, 42653, 41964, 16889, 29783, 17769]
    plan = plan_epoch([[40, 40, 30]], 5, 2, World(1, 3, 1, 2), batch_size=4, drop_last=False, window=8,
                      history=(Resume(2, 3),))
    assert [(b, i.tolist()) for b, _, i in plan] == [(1, [54, 56, 50, 65]), (3, [59, 60, 75, 1]), (5, [7, 4, 3, 8]), (7, [15])]


_histories = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), max_size=3)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), world_size=st.integers(1, 6), workers=st.integers(1, 4),
       batch_size=st.integers(1, 5), drop_last=st.booleans(), shuffle=st.booleans(), window=st.integers(1, 20),
       stretches=_histories, same_world=st.booleans(), data=st.data())
def test_lazy_plan_equals_the_materialised_one(sizes, world_size, workers, batch_size, drop_last, shuffle, window,
                                               stretches, same_world, data):
    history = tuple(Resume(w, b) for w, b in stretches)
    if history and same_world:
        world_size = history[-1].world_size
    rank = data.draw(st.integers(0, world_size - 1))
    total = sum(sizes)
    try:
        expected = _reference_positions(total, world_size, rank, batch_size, drop_last, history)
    except PlanError:
        with pytest.raises(PlanError):
            rank_positions(total, world_size, rank, batch_size, drop_last, history)
        with pytest.raises(PlanError):
            plan_epoch([sizes], 1, 2, World(rank, world_size), batch_size=batch_size, drop_last=drop_last, history=history)
        return
    assert [b.tolist() for b in rank_positions(total, world_size, rank, batch_size, drop_last, history)] == \
        [b.tolist() for b in expected]
    assert rank_batch_count(total, world_size, rank, batch_size, drop_last, history) == len(expected)
    assert rank_sample_count(total, world_size, rank, batch_size, drop_last, history) == sum(map(len, expected))
    for worker in range(workers):
        world = World(rank, world_size, worker, workers)
        kw = dict(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, window=window, history=history)
        plan = plan_epoch([sizes], 3, 1, world, **kw)
        reference = _items(_reference_plan([sizes], 3, 1, world, **kw))
        assert len(plan) == len(reference)
        assert _items(plan) == reference
        assert all(type(b) is int and s.dtype == np.int64 and i.dtype == np.int64 for b, s, i in plan)
        assert _items(plan[k] for k in reversed(range(len(plan)))) == reference[::-1], "random access"


@pytest.mark.parametrize(("batch_size", "drop_last"), [(1, True), (3, False)])
def test_lazy_plan_across_chunks_in_any_access_order(batch_size, drop_last):
    """Enough batches for several of the plan's chunks: in order, with look-ahead, backwards, at random."""
    sizes, history = [1000] * 45 + [517], (Resume(3, 2000 // batch_size), Resume(2, 1500 // batch_size))
    for world in (World(0, 1, 1, 2), World(1, 2, 0, 1)):
        kw = dict(batch_size=batch_size, drop_last=drop_last, shuffle=True, window=1000, history=history)
        reference = _items(_reference_plan([sizes], 8, 0, world, **kw))
        assert sum(len(ids) for *_, ids in reference) > 2 * 8192, "several chunks"
        plan = plan_epoch([sizes], 8, 0, world, **kw)
        assert _items(plan) == reference
        plan = plan_epoch([sizes], 8, 0, world, **kw)
        ahead = []
        for i in range(len(plan)):  # as the loader asks: each batch, and one a few batches later
            ahead.append(plan[i])
            plan[min(i + 3, len(plan) - 1)]
        assert _items(ahead) == reference
        picks = np.random.default_rng(0).integers(0, len(plan), 60).tolist() + [-1, -len(plan)]
        assert _items(plan[k] for k in picks) == [reference[k] for k in picks]
        assert _items(plan[5:20:3]) == reference[5:20:3]
        with pytest.raises(IndexError):
            plan[len(plan)]


def test_plan_laws_at_a_large_size_with_an_elastic_history():
    """30M samples, three stretches in other worlds, then the last world: the counts add up over every
    rank (arithmetic only), sampled ranks' positions are disjoint, and sampled workers' plans are their
    rank's batches, dealt round-robin."""
    total, batch_size = 30_000_000, 8
    sizes = [1000] * (total // 1000)
    worlds = (256, 192, 320)
    for drop_last, final in ((True, 128), (False, 320), (False, 100)):
        history: tuple[Resume, ...] = ()
        seen, taken = [], 0
        for i, world_size in enumerate(worlds):
            k = rank_batch_count(total, world_size, 0, batch_size, drop_last, history) // (3 - i) - 7
            after = (*history, Resume(world_size, k))
            before_counts = [rank_sample_count(total, world_size, r, batch_size, drop_last, history) for r in range(world_size)]
            after_counts = [rank_sample_count(total, world_size, r, batch_size, drop_last, after) for r in range(world_size)]
            taken += sum(before_counts) - sum(after_counts)
            for r in (0, 1, world_size // 2, world_size - 2, world_size - 1):
                seen += rank_positions(total, world_size, r, batch_size, drop_last, history)[:k]
            history = after
        counts = {rank_batch_count(total, final, r, batch_size, drop_last, history) for r in range(final)}
        assert len(counts) == 1, "equal batch counts"
        left = sum(rank_sample_count(total, final, r, batch_size, drop_last, history) for r in range(final))
        if drop_last:
            assert 0 <= total - taken - left < final * batch_size, "only the last split drops"
        else:
            assert taken + left == total, "nothing lost"
        for r in (0, 1, final // 2, final - 1):
            batches = rank_positions(total, final, r, batch_size, drop_last, history)
            seen += batches
            if r in (1, final - 1):
                expected = epoch_order(sizes, [3, 4], True, 16384, np.concatenate(batches))
                yielded = []
                for w in range(8):
                    plan = plan_epoch([sizes], 3, 4, World(r, final, w, 8), batch_size=batch_size, drop_last=drop_last,
                                      history=history)
                    yielded += [(b, ids) for b, _, ids in plan]
                yielded.sort(key=lambda item: item[0])
                assert [b for b, _ in yielded] == list(range(len(batches)))
                assert [len(ids) for _, ids in yielded] == [len(b) for b in batches]
                np.testing.assert_array_equal(np.concatenate([ids for _, ids in yielded]), expected)
        positions = np.concatenate(seen)
        assert positions.min() >= 0 and positions.max() < total
        assert np.unique(positions).size == positions.size, "no position twice among the sampled ranks"


# --- mixing: a windowed, exact scheme ---

def test_windowed_mix_laws_over_many_windows():
    """Three sources over many mixing windows: exact shares, each pass of a source once, random
    access equal to the whole order, deterministic in (seed, epoch), epochs differ."""
    sources = [[700] * 100, [300] * 50, [997, 3]]
    mix = Mix.of([70_000, 15_000, 1000], [0.6, 0.3, 0.1], 60_000)
    assert mix.counts == (36_000, 18_000, 6000)
    total = sum(mix.counts)
    source, ids = mixed_order(sources, mix, 5, 1, True, 256, np.arange(total))
    for s, (share, size) in enumerate(zip(mix.counts, (70_000, 15_000, 1000))):
        taken = ids[source == s]
        assert taken.size == share
        for run in range(-(-share // size)):  # each pass over the source a permutation (the last one partial)
            part = taken[run * size : (run + 1) * size].tolist()
            assert len(set(part)) == len(part) and set(part) <= set(range(size))
    again = mixed_order(sources, mix, 5, 1, True, 256, np.arange(total))
    assert (again[0] == source).all() and (again[1] == ids).all()
    picks = np.random.default_rng(1).integers(0, total, 5000)
    some = mixed_order(sources, mix, 5, 1, True, 256, picks)
    assert (some[0] == source[picks]).all() and (some[1] == ids[picks]).all()
    other = mixed_order(sources, mix, 5, 2, True, 256, np.arange(total))
    assert (other[0] != source).mean() > 0.3, "epochs differ"
    for start in range(0, total, 6000):  # well mixed: each stretch near the shares
        part = source[start : start + 6000]
        for s, weight in enumerate((0.6, 0.3, 0.1)):
            assert abs((part == s).mean() - weight) < 0.03


def test_mixed_plan_equals_the_mixed_order_of_the_rank_positions():
    sources = [[500] * 30, [200] * 20]
    mix = Mix.of([15_000, 4000], [0.5, 0.5], 20_000)
    history = (Resume(3, 100), Resume(2, 50))
    for world, drop_last in ((World(1, 3, 1, 2), True), (World(0, 1, 0, 3), False)):
        kw = dict(batch_size=4, drop_last=drop_last, shuffle=True, window=64, mix=mix, history=history)
        assert _items(plan_epoch(sources, 2, 3, world, **kw)) == _items(_reference_plan(sources, 2, 3, world, **kw))


def test_mix_of_an_epoch_past_numpys_hypergeometric_bound():
    """Over 10**9 samples of a kind, the tree's top splits still give exact, in-range answers."""
    sources = [[1_500_000_000], [1_200_000_000], [300_000_000]]
    mix = Mix.of([1_500_000_000, 1_200_000_000, 300_000_000], None, None)
    total = sum(mix.counts)
    picks = np.concatenate([np.arange(8192), np.arange(total // 2, total // 2 + 8192), np.arange(total - 8192, total)])
    source, ids = mixed_order(sources, mix, 0, 0, True, 64, picks)
    again = mixed_order(sources, mix, 0, 0, True, 64, picks)
    assert (source == again[0]).all() and (ids == again[1]).all()
    assert set(source.tolist()) == {0, 1, 2}
    for s, size in enumerate((1_500_000_000, 1_200_000_000, 300_000_000)):
        mine = ids[source == s]
        assert len(set(mine.tolist())) == mine.size and mine.min() >= 0 and mine.max() < size


# -- the table of shuffles -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SHUFFLES))
def test_every_shuffle_is_a_deterministic_permutation_asked_in_any_chunks(name):
    sizes = [7, 0, 30, 1, 12]
    total = sum(sizes)
    whole = epoch_order(sizes, [5, 2], name, 8, np.arange(total))
    assert sorted(whole.tolist()) == list(range(total))
    assert np.array_equal(epoch_order(sizes, [5, 2], name, 8, np.arange(total)), whole)
    picked = np.array([total - 1, 3, 17, 0, 3])
    assert np.array_equal(get_shuffle(name)(sizes, [5, 2], 8)(picked), whole[picked])


def test_shards_then_blocks_keeps_blocks_of_neighbours_together():
    """Each aligned block of BLOCK positions holds BLOCK neighbours of one shard (shards and windows of
    multiples of BLOCK), in an order of its own; the blocks are permuted within their window."""
    sizes = [64, 0, 48, 128, 16]
    total, window = sum(sizes), 32
    order = epoch_order(sizes, [3, 1], "shards-then-blocks", window, np.arange(total))
    for start in range(0, total, BLOCK):
        block = np.sort(order[start : start + BLOCK])
        assert block[0] % BLOCK == 0 and np.array_equal(block, np.arange(block[0], block[0] + BLOCK)), start
    assert not all(np.array_equal(order[s : s + BLOCK], np.sort(order[s : s + BLOCK])) for s in range(0, total, BLOCK))
    windowed = epoch_order(sizes, [3, 1], "shards-then-window", window, np.arange(total))
    for start in range(0, total, window):  # (the same shards, in the same windows)
        assert sorted(order[start : start + window]) == sorted(windowed[start : start + window])


def test_shuffle_true_and_false_are_table_entries():
    assert shuffle_name(True) == "shards-then-window" and shuffle_name(False) == "none"
    sizes, positions = [5, 9, 3], np.arange(17)
    for flag in (True, False):
        assert np.array_equal(epoch_order(sizes, [1, 4], flag, 4, positions),
                              epoch_order(sizes, [1, 4], shuffle_name(flag), 4, positions))
    assert not np.array_equal(epoch_order(sizes, [1, 4], True, 4, positions), epoch_order(sizes, [1, 5], True, 4, positions))
    with pytest.raises(ValueError, match="shuffle must be True, False or one of"):
        get_shuffle("sideways")
