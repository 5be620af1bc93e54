"""Several datasets through one loader: concatenated, or mixed in exact shares; resumable."""

from __future__ import annotations

import collections

import pytest

from pipeline import make_stream_loader
from shard_tools.pack import PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.sa1b import write_sa1b
from conftest import split_keys

SMALL = dict(image_size=32, mask_size=8, max_masks=2)


@pytest.fixture(scope="module")
def second(tmp_path_factory) -> str:
    """Another SA-1B dataset (train only), keys mix_<id> so samples show their source."""
    src = tmp_path_factory.mktemp("mix-src")
    write_sa1b(src, images=6, size=(48, 64), masks=(2, 4), layout="folder", seed=9)
    for path in sorted(src.iterdir()):
        path.rename(src / path.name.replace("sa_", "mix_"))
    out = tmp_path_factory.mktemp("mix-shards")
    pack(Sa1bSource(), [str(src)], str(out), PackOptions(shard_samples=4), progress=False)
    return str(out)


def _keys(loader, epoch):
    loader.set_epoch(epoch)
    return [k for b in loader for k in b["keys"]]


def test_concatenation_yields_every_sample_of_every_source_once(sa1b_dataset, second):
    loader = make_stream_loader([sa1b_dataset, second], "train", batch_size=2, num_workers=2, drop_last=False, **SMALL)
    keys = _keys(loader, 0)
    first = split_keys(sa1b_dataset)
    assert sorted(keys) == sorted(first + [f"mix_{i}" for i in range(1, 7)])
    assert keys != sorted(keys), "shuffled across sources"


def test_weighted_mix_has_exact_shares_per_epoch(sa1b_dataset, second):
    loader = make_stream_loader([sa1b_dataset, second], "train", batch_size=3, num_workers=2, weights=[0.25, 0.75],
                                epoch_size=24, **SMALL)
    for epoch in (0, 1):
        keys = _keys(loader, epoch)
        counts = collections.Counter(k.split("_")[0] for k in keys)
        assert counts == {"sa": 6, "mix": 18}
        mix = [k for k in keys if k.startswith("mix_")]
        for run in range(3):  # the 6-sample source is cycled: each pass takes each sample once
            assert sorted(mix[run * 6 : (run + 1) * 6]) == sorted(f"mix_{i}" for i in range(1, 7))
    assert _keys(loader, 0) != _keys(loader, 1)
    again = make_stream_loader([sa1b_dataset, second], "train", batch_size=3, num_workers=0, weights=[0.25, 0.75],
                               epoch_size=24, **SMALL)
    assert _keys(again, 1) == _keys(loader, 1), "deterministic for (seed, epoch), any workers"


def test_default_mix_stops_before_a_source_runs_out(sa1b_dataset, second):
    loader = make_stream_loader([sa1b_dataset, second], "train", batch_size=1, num_workers=0, weights=[1, 1],
                                drop_last=False, **SMALL)
    keys = _keys(loader, 0)
    mixed = sorted(k for k in keys if k.startswith("mix_"))
    ours = [k for k in keys if not k.startswith("mix_")]
    assert mixed == sorted(f"mix_{i}" for i in range(1, 7)), "all 6 of the second: it runs out then"
    assert len(ours) == len(set(ours)) == 6 and set(ours) <= set(split_keys(sa1b_dataset)), "as many of the first, once"


def test_mixed_resumption_equals_uninterrupted(sa1b_dataset, second):
    def make(**kw):
        return make_stream_loader([sa1b_dataset, second], "train", batch_size=2, num_workers=2, weights=[0.5, 0.5],
                                  epoch_size=16, **SMALL, **kw)

    full = _keys(make(), 2)
    first = make()
    first.set_epoch(2)
    taken = []
    for batch in first:
        taken += batch["keys"]
        if len(taken) == 6:
            break
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert taken + _keys(resumed, 2) == full
    with pytest.raises(ValueError, match="fingerprint"):
        make_stream_loader([sa1b_dataset, second], "train", batch_size=2, num_workers=0, weights=[0.5, 0.5],
                           epoch_size=18, **SMALL).load_state_dict(first.state_dict())
