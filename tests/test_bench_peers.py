"""bench/sa1b_peers.py: each installed peer's loader yields every sample once per epoch, decoded exactly as
this project's loader decodes it (image, masks and every other field), in epochs that choose different masks."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from pipeline import make_stream_loader
from pipeline.kinds.sa1b import Sa1b, Sa1bOptions
from shard_tools.pack import PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.sa1b import write_sa1b

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import sa1b_peers  # noqa: E402

OPTIONS = dict(image_size=64, mask_size=32, max_masks=4)  # fewer masks than most samples have: epochs differ
KEYS = {f"sa_{i}" for i in range(1, 5)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """4 samples packed 2 to a shard (a shard for each of 2 workers)."""
    src, out = tmp_path_factory.mktemp("peers-src"), tmp_path_factory.mktemp("peers-data") / "shards"
    write_sa1b(src, images=4, size=(96, 144), masks=(5, 12), seed=2)
    pack(Sa1bSource(), [str(src)], str(out), PackOptions(shard_samples=2, workers=1), progress=False)
    return out


def epoch_samples(loader, epoch: int) -> dict[str, dict]:
    """Each sample of an epoch, by key, padding trimmed; a key seen twice fails."""
    loader.set_epoch(epoch)
    samples = [s for batch in loader for s in Sa1b(Sa1bOptions(**OPTIONS)).unbatch(batch)]
    assert len({s["keys"] for s in samples}) == len(samples)
    return {s["keys"]: s for s in samples}


@pytest.mark.parametrize("name", sorted(sa1b_peers.PEERS))
def test_peer_yields_what_the_loader_yields(name: str, shards: pathlib.Path, tmp_path: pathlib.Path) -> None:
    peer = sa1b_peers.PEERS[name]
    if peer.version() is None:
        pytest.skip(f"{peer.dist} not installed (make bench-peers)")
    source = shards
    if peer.convert is not None:
        source = tmp_path / name
        peer.convert(shards, source)
    decode = sa1b_peers.PeerDecode(**OPTIONS)
    theirs = sa1b_peers.PeerLoader(peer.loader(source, decode, 2, 2), decode)
    ours = make_stream_loader(str(shards), "train", batch_size=2, num_workers=2, **OPTIONS)
    epochs = []
    for epoch in (0, 1):
        expected, got = epoch_samples(ours, epoch), epoch_samples(theirs, epoch)
        assert set(expected) == set(got) == KEYS
        for key, sample in expected.items():
            assert got[key].keys() == sample.keys()
            for field, value in sample.items():
                same = torch.equal(got[key][field], value) if isinstance(value, torch.Tensor) else got[key][field] == value
                assert same, (key, field)
        epochs.append(expected)
    assert any(not torch.equal(epochs[0][key]["masks"], epochs[1][key]["masks"]) for key in KEYS)
