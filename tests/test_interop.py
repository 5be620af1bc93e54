"""The shards are plain WebDataset tar files: stock `webdataset` and `tarfile` read them."""

from __future__ import annotations

import pathlib
import tarfile

import msgpack
import webdataset

from pipeline.format import Manifest, decode_array
from conftest import index_of


def test_stock_webdataset_reads_the_shards(sa1b_dataset):
    manifest = Manifest.from_json((pathlib.Path(sa1b_dataset) / "manifest.json").read_bytes(), "m")
    for shards in manifest.splits.values():
        urls = [str(pathlib.Path(sa1b_dataset) / s.name) for s in shards]
        samples = list(webdataset.WebDataset(urls, shardshuffle=False))
        assert [s["__key__"] for s in samples] == [k for shard in shards for k in index_of(sa1b_dataset, shard).key_list()]
        for sample in samples:
            assert set(sample) >= {"jpg", "msgpack"}
            assert sample["jpg"][:2] == b"\xff\xd8"
            record = msgpack.unpackb(sample["msgpack"])
            assert f"{sample['__key__']}.jpg" == record["image"]["file_name"]
            assert decode_array(record["bbox"]).shape == (len(record["counts"]), 4)


def test_tarfile_lists_plain_members(sa1b_dataset):
    shard = next(pathlib.Path(sa1b_dataset).glob("train-*.tar"))
    with tarfile.open(shard) as archive:
        members = archive.getmembers()
    assert all(m.isfile() and m.mtime == 0 and m.uid == 0 and "/" not in m.name for m in members)
    assert [m.name.split(".")[1] for m in members] == ["jpg", "msgpack"] * (len(members) // 2)
