"""pipeline.plan: exactly-once, equal per-rank batch counts, determinism, for every world."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.plan import Mix, PlanError, Resume, World, epoch_order, mixed_order, plan_epoch, rank_batch_sizes, rank_positions

SIZES = {
    "fewer shards than workers": [9],
    "uneven with empty shard": [5, 0, 7, 3, 1],
    "many small": [2] * 13,
    "tiny": [3, 2],
}


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
        try:
            ranks = _epoch(sizes, world_size, workers, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle)
        except PlanError:
            # only drop_last=False with batch_size 1 and an uneven split, or fewer samples than ranks
            assert not drop_last and (batch_size == 1 or total < world_size)
            continue
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


def test_rank_batch_count_matches_plan():
    for total, world_size, batch_size, drop_last in itertools.product(range(0, 40), range(1, 6), range(1, 6), (True, False)):
        try:
            start, sizes = rank_batch_sizes(total, world_size, 0, batch_size, drop_last)
        except PlanError:
            continue
        plan = plan_epoch([[total]], 0, 0, World(0, world_size), batch_size=batch_size, drop_last=drop_last)
        assert len(plan) == len(sizes) and [len(ids) for _, _, ids in plan] == sizes and start == 0


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
        try:
            full = _rank_runs(total, world_size, batch_size, drop_last)
        except PlanError:
            continue
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
            try:
                first = _rank_runs(total, worlds[0], batch_size, drop_last)
            except PlanError:
                continue
            for k in range(len(first[0]) + 1):
                history, seen, ok = [], [], True
                for i, world_size in enumerate(worlds):
                    try:
                        runs = _rank_runs(total, world_size, batch_size, drop_last, tuple(history))
                    except PlanError:
                        ok = False
                        break
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
