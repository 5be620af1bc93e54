"""Schema 3: the per-shard index (round trip, every malformed form refused with a named error),
the manifest that lists shards only, schema-2 datasets read and upgraded in place, and the cost of
opening a dataset growing with its shards, not its samples."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from pipeline import ManifestError, ShardstreamError, make_stream_loader
from pipeline.errors import ShardIndexError
from pipeline.format import MAX_INDEX_BYTES, ShardIndex
from shard_tools.cli import main
from conftest import indexed
from test_embeddings import emb_dataset, emb_src  # noqa: F401  (fixtures)

SMALL = dict(image_size=32, mask_size=8, max_masks=2)


def _index() -> ShardIndex:
    return ShardIndex.build(["a", "b-2", "c_3"], [1, 3, 2],
                            [[("jpg", 0, 10), ("msgpack", 1024, 600)], [("jpg", 2560, 0)], [("bin", 3072, 1), ("x.y", 4096, 7)]])


def _parse(data: bytes, samples: int = 3, units: int = 6, shard_bytes: int = 8192) -> ShardIndex:
    return ShardIndex.from_bytes(data, "i.idx", samples=samples, units=units, shard_bytes=shard_bytes)


def test_index_round_trip():
    index = _index()
    back = _parse(index.to_bytes(8192))
    assert back.key_list() == ["a", "b-2", "c_3"] and back.units.tolist() == [1, 3, 2]
    assert back.spans.tolist() == [[0, 2560], [2560, 3072], [3072, 5120]]
    assert [back.sample_members(i) for i in range(3)] == [index.sample_members(i) for i in range(3)]
    assert back.sample_members(2) == [("bin", 3072, 1), ("x.y", 4096, 7)]
    assert back.unit_starts.tolist() == [0, 1, 4, 6] and back.to_bytes(8192) == index.to_bytes(8192)


def _edit(data: bytes, section: str, value: int, at: int = 0) -> bytes:
    """The index bytes with one entry of one array set to `value` (n=3 samples, m=5 members)."""
    n, m = 3, 5
    offsets = {"spans": (64, 8), "member_offsets": (64 + 16 * n, 8), "member_sizes": (64 + 16 * n + 8 * m, 8),
               "units": (64 + 16 * n + 16 * m, 4), "key_ends": (64 + 20 * n + 16 * m, 4)}
    start, size = offsets[section]
    out = bytearray(data)
    out[start + at * size : start + (at + 1) * size] = value.to_bytes(size, "little")
    return bytes(out)


@pytest.mark.parametrize(("name", "change", "expect"), [
    ("truncated", lambda d: d[:-3], "bytes"),
    ("truncated header", lambda d: d[:40], "shorter than its header"),
    ("extended", lambda d: d + b"\0", "bytes"),
    ("not an index", lambda d: b"PK\3\4" + d[4:], "not a version-1"),
    ("samples out of order", lambda d: _edit(_edit(d, "spans", 2560, 0), "spans", 3072, 1), "out of order"),
    ("span past the shard", lambda d: _edit(d, "spans", 9000, 5), "past the shard"),
    ("member outside its span", lambda d: _edit(d, "member_offsets", 1500, 1), "members out of order"),
    ("members overlapping", lambda d: _edit(d, "member_sizes", 5000, 0), "members out of order"),
    ("a sample without units", lambda d: _edit(d, "units", 0, 1), "no units"),
    ("units disagree", lambda d: _edit(d, "units", 2, 1), "the manifest says"),
    ("key table overrun", lambda d: _edit(d, "key_ends", 90, 2), "keys must be"),
    ("unsafe key", lambda d: d.replace(b"b-2", b"../"), "keys must be"),
])
def test_every_malformed_index_is_refused_naming_the_file(name, change, expect):
    data = _index().to_bytes(8192)
    if name == "units disagree":  # the header's units too, so only the manifest disagrees
        with pytest.raises(ShardIndexError, match=expect):
            _parse(data, units=5)
        return
    with pytest.raises(ShardIndexError, match=expect) as caught:
        _parse(change(data))
    assert str(caught.value).startswith("i.idx: invalid shard index"), name


@pytest.mark.parametrize(("samples", "shard_bytes"), [(4, 8192), (3, 4000)])
def test_index_disagreeing_with_the_manifest_is_refused(samples, shard_bytes):
    with pytest.raises(ShardIndexError, match="the manifest says"):
        _parse(_index().to_bytes(8192), samples=samples, shard_bytes=shard_bytes)


def _corrupt_index(root: pathlib.Path, data: bytes, *, fix_checksum: bool) -> str:
    """Replace the first train shard's index with `data` (and its manifest entry's checksum)."""
    manifest = json.loads((root / "manifest.json").read_text())
    columns = manifest["splits"]["train"]["shards"]
    name = columns["index"][0]
    (root / name).write_bytes(data)
    if fix_checksum:
        columns["index_sha256"][0] = hashlib.sha256(data).hexdigest()
        columns["index_bytes"][0] = len(data)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return name


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fault", ["checksum", "missing", "malformed", "oversized"])
def test_loader_names_a_bad_index(sa1b_dataset, tmp_path, fault, workers):
    root = tmp_path / "copy"
    shutil.copytree(sa1b_dataset, root)
    (shard, index), = indexed(str(root))[:1]
    good = (root / shard.index.name).read_bytes()
    if fault == "missing":
        (root / shard.index.name).unlink()
    elif fault == "checksum":
        _corrupt_index(root, good[:-1] + bytes([good[-1] ^ 1]), fix_checksum=False)
    elif fault == "malformed":
        _corrupt_index(root, good[:-8], fix_checksum=True)
    else:
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["splits"]["train"]["shards"]["index_bytes"][0] = MAX_INDEX_BYTES + 1
        (root / "manifest.json").write_text(json.dumps(manifest))
    expect = {"checksum": "SHA-256", "missing": "is missing", "malformed": "invalid shard index",
              "oversized": "more than"}[fault]
    loader = make_stream_loader(str(root), "train", batch_size=1, num_workers=workers, shuffle=False, **SMALL)
    with pytest.raises(ShardIndexError if not workers else ShardstreamError, match=expect) as caught:
        list(loader)
    assert shard.index.name in str(caught.value)
    assert main(["-q", "verify", str(root)]) == 1


def _manifest_json(root: pathlib.Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def test_a_shard_listed_twice_or_a_wrong_split_count_is_refused(sa1b_dataset, tmp_path):
    for fault in ("twice", "samples", "units"):
        root = tmp_path / fault
        shutil.copytree(sa1b_dataset, root)
        manifest = _manifest_json(root)
        split = manifest["splits"]["train"]
        if fault == "twice":
            for column in split["shards"].values():
                column.append(column[0])
            split["samples"] += split["shards"]["samples"][0]
            split["units"] += split["shards"]["units"][0]
        else:
            split[fault] += 1
        (root / "manifest.json").write_text(json.dumps(manifest))
        expect = "listed more than once" if fault == "twice" else "its shards hold"
        with pytest.raises(ManifestError, match=expect):
            make_stream_loader(str(root), "train", batch_size=1, num_workers=0, **SMALL)
        assert main(["-q", "verify", str(root)]) == 2


def _downgrade(root: pathlib.Path) -> None:
    """Rewrite a packed dataset as schema 2 wrote it: per-sample keys, offsets and units in the manifest, no index files."""
    manifest = _manifest_json(root)
    for name, split in manifest["splits"].items():
        shards = []
        for shard, index in indexed(str(root), name):
            entry = {"name": shard.name, "samples": shard.samples, "bytes": shard.bytes, "sha256": shard.sha256,
                     "keys": index.key_list(), "offsets": [*index.spans[:, 0].tolist(), int(index.spans[-1, 1])]}
            if shard.units != shard.samples:
                entry["units"] = index.units.tolist()
            shards.append(entry)
            (root / shard.index.name).unlink()
        manifest["splits"][name] = {"samples": split["samples"], "shards": shards}
    manifest["schema_version"] = 2
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _epoch(root: str) -> list[list[str]]:
    loader = make_stream_loader(root, "train", batch_size=2, num_workers=2, seed=3, drop_last=False, **SMALL)
    loader.set_epoch(1)
    return [b["keys"] for b in loader]


@pytest.mark.parametrize("dataset", ["sa1b_dataset", "emb_dataset"])
def test_schema_2_streams_as_before_and_upgrades_in_place_byte_identical(request, dataset, tmp_path, capsys, caplog):
    packed = pathlib.Path(request.getfixturevalue(dataset))
    old = tmp_path / "old"
    shutil.copytree(packed, old)
    _downgrade(old)
    shards = {n: d for n, d in _files(old).items() if n.endswith(".tar")}
    if dataset == "sa1b_dataset":
        assert _epoch(str(old)) == _epoch(str(packed))
        assert "shard-pack upgrade" in caplog.text, "a hint"
    assert main(["upgrade", str(old)]) == 0
    assert "upgraded from schema 2 to 4" in capsys.readouterr().out
    assert _files(old) == _files(packed), "indexes and manifest as packing writes them, shards untouched"
    assert {n: d for n, d in _files(old).items() if n.endswith(".tar")} == shards
    assert main(["upgrade", str(old)]) == 0 and "nothing to do" in capsys.readouterr().out
    assert main(["-q", "verify", str(old)]) == 0


def test_verify_checks_each_index_against_its_shard(sa1b_dataset, tmp_path, capsys):
    root = tmp_path / "copy"
    shutil.copytree(sa1b_dataset, root)
    (shard, index), = indexed(str(root))[:1]
    members = [index.sample_members(i) for i in range(index.samples)]
    (ext, at, size), second = members[0]
    members[0] = [(ext, at, size - 1), second]  # a plausible index that disagrees with the shard
    wrong = ShardIndex.build(index.key_list(), index.units.tolist(), members).to_bytes(shard.bytes)
    _corrupt_index(root, wrong, fix_checksum=True)
    assert main(["-q", "verify", str(root)]) == 1
    assert f"sample {index.key(0)!r}: members" in capsys.readouterr().out


_RSS = """
import resource, sys, gc
from pipeline import make_stream_loader
import pipeline.storage, numpy, torch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
make_stream_loader(sys.argv[2], "train", batch_size=8, num_workers=0, image_size=32, mask_size=8, max_masks=2)
gc.collect()
before = rss()
loader = make_stream_loader(sys.argv[1], "train", batch_size=8, num_workers=0, image_size=32, mask_size=8, max_masks=2)
gc.collect()
print(rss() - before, len(loader))
"""


def test_opening_a_dataset_does_not_grow_with_its_samples(tmp_path):
    from shard_tools.samples.synthetic import write_synthetic

    warm = tmp_path / "warm"
    write_synthetic(warm, 1000)
    grown = {}
    for samples in (2_000, 50_000):
        write_synthetic(tmp_path / str(samples), samples)
        out = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path / str(samples)), str(warm)],
                             capture_output=True, text=True, check=True).stdout.split()
        grown[samples] = int(out[0])
        assert int(out[1]) == samples // 8
    assert grown[50_000] - grown[2_000] < 2 << 20, grown  # schema 2 held ~220 B per sample: +10 MB here
