"""`shard-pack index`: original SA-1B archives and WebDataset tars indexed in place, streamed back."""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import sys
import tarfile
import uuid

import numpy as np
import pytest
import s3fs
from hypothesis import given
from hypothesis import strategies as st
import torch
import webdataset

from pipeline import make_stream_loader
from pipeline.errors import InputError, SampleError, ShardError, ShardstreamError
from pipeline.format import Manifest, parse_json
from pipeline.kinds.sa1b import Sa1b, Sa1bOptions
from pipeline.storage import read_manifest
from shard_tools.cli import main
from shard_tools.index import SeenKeys, index_sa1b, index_webdataset
from shard_tools.samples.locals3 import storage_options
from test_hostile import _corpus
from conftest import indexed, new_bucket, split_keys
from procs import run_bounded

SMALL = dict(image_size=32, mask_size=8, max_masks=2)
SPLITS = (("train", 0.7), ("val", 0.3))  # as the packed fixture's


def _by_key(root: str, split: str = "train", **kwargs) -> dict[str, dict[str, torch.Tensor]]:
    """Every sample of one epoch, by key (each with its own masks only)."""
    settings = dict(batch_size=2, num_workers=0, seed=5, drop_last=False, **SMALL)
    settings.update(kwargs)
    samples = {}
    for batch in make_stream_loader(root, split, **settings):
        for sample in Sa1b(Sa1bOptions(**SMALL)).unbatch(batch):
            samples[sample.pop("keys")] = sample
    return samples


def _assert_same(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert sorted(a) == sorted(b) and a
    for key in a:
        assert sorted(a[key]) == sorted(b[key])
        for field in a[key]:
            assert torch.equal(a[key][field], b[key][field]), (key, field)


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _members(archive: pathlib.Path) -> list[tarfile.TarInfo]:
    with tarfile.open(archive) as tar:
        return [m for m in tar.getmembers() if m.isfile()]


def _pairs(sa1b_src: pathlib.Path) -> list[tuple[str, bytes, bytes]]:
    """(key, jpg, json) of each image of the fixture's first archive."""
    with tarfile.open(sa1b_src / "sa_000000.tar") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    keys = sorted({name.partition(".")[0] for name in files})
    return [(key, files[f"{key}.jpg"], files[f"{key}.json"]) for key in keys]


def _tar(path: pathlib.Path, members: list[tuple[str, bytes]], form: int = tarfile.GNU_FORMAT) -> pathlib.Path:
    with tarfile.open(path, "w", format=form) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1.5  # (a float mtime: pax writes an extended header for it)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_index_streams_what_pack_streams(sa1b_src, sa1b_dataset, tmp_path, capsys):
    out = tmp_path / "indexed"
    assert main(["-q", "index", "sa1b", str(sa1b_src), str(out), "--split", "train=0.7,val=0.3", "--workers", "1"]) == 0
    assert "indexed 14 samples" in capsys.readouterr().out
    manifest = read_manifest(str(out))
    assert (manifest.kind, manifest.origin, manifest.members) == ("sa1b", "indexed", ("jpg", "json"))
    assert {p.suffix for p in out.iterdir()} == {".json", ".idx"}, "no copy of the data"
    allowed = [str(sa1b_src)]  # (the archives lie outside the dataset's folder)
    for split in ("train", "val"):
        assert sorted(split_keys(str(out), split)) == sorted(split_keys(sa1b_dataset, split)), "the same splits"
        _assert_same(_by_key(str(out), split, allowed_roots=allowed), _by_key(sa1b_dataset, split))
        _assert_same(_by_key(str(out), split, num_workers=2, seed=9, allowed_roots=allowed),
                     _by_key(sa1b_dataset, split, num_workers=2, seed=9))
    assert main(["-q", "verify", str(out), "--allow-root", str(sa1b_src)]) == 0


def test_index_is_byte_identical_for_any_workers_and_repeats(sa1b_src, tmp_path):
    runs = []
    for i, workers in enumerate((1, 2, 2)):
        out = tmp_path / f"run{i}"
        summary = index_sa1b([str(sa1b_src)], str(out), splits=SPLITS, workers=workers, progress=False)
        assert (summary.samples, summary.archives, summary.skipped) == (14, 2, 0)
        runs.append(_files(out))
    assert runs[0] == runs[1] == runs[2]


def test_archives_under_out_are_named_relative_to_it(sa1b_src, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(sa1b_src, out / "archives")
    index_sa1b([str(out / "archives")], str(out), progress=False)
    assert read_manifest(str(out)).splits["train"].names == ["archives/sa_000000.tar", "archives/sa_000001.tar"]
    moved = tmp_path / "moved"
    shutil.move(out, moved)  # the dataset travels with its archives
    assert len(_by_key(str(moved))) == 14


def test_members_apart_and_json_before_jpg(sa1b_src, tmp_path):
    (a, jpg_a, json_a), (b, jpg_b, json_b), (c, jpg_c, json_c) = _pairs(sa1b_src)[:3]
    plain = _tar(tmp_path / "plain.tar", [(f"{a}.jpg", jpg_a), (f"{a}.json", json_a), (f"{b}.jpg", jpg_b),
                                          (f"{b}.json", json_b), (f"{c}.jpg", jpg_c), (f"{c}.json", json_c)])
    mixed = _tar(tmp_path / "mixed.tar", [("./", b""), (f"./{b}.json", json_b), (f"{a}.jpg", jpg_a), ("notes.txt", b"x"),
                                          (f"{b}.jpg", jpg_b), (f"{c}.jpg", jpg_c), (f"{a}.json", json_a),
                                          (f"{c}.json", json_c)], tarfile.PAX_FORMAT)
    for archive in (plain, mixed):
        index_sa1b([str(archive)], str(tmp_path / archive.stem), progress=False)
    (_, index), = indexed(str(tmp_path / "mixed"))
    offsets = {m.name: m.offset_data - 512 for m in _members(mixed)}
    assert index.key_list() == [b, a, c], "samples in order of their first member"
    assert index.sample_members(0) == [("json", offsets[f"./{b}.json"], len(json_b)), ("jpg", offsets[f"{b}.jpg"], len(jpg_b))]
    assert index.sample_members(1) == [("jpg", offsets[f"{a}.jpg"], len(jpg_a)), ("json", offsets[f"{a}.json"], len(json_a))]
    allowed = [str(tmp_path)]
    _assert_same(_by_key(str(tmp_path / "mixed"), allowed_roots=allowed), _by_key(str(tmp_path / "plain"), allowed_roots=allowed))
    assert main(["-q", "verify", str(tmp_path / "mixed"), "--allow-root", str(tmp_path)]) == 0


def test_webdataset_tars_indexed_as_webdataset_groups_them(tmp_path, capsys):
    src = tmp_path / "wds"
    src.mkdir()
    rng = np.random.default_rng(0)
    with webdataset.ShardWriter(str(src / "part-%03d.tar"), maxcount=7, verbose=0) as sink:
        for i in range(20):
            sample = {"__key__": f"s{i:04d}", "bin": rng.bytes(int(rng.integers(0, 3000))), "txt": f"caption {i}"}
            if i % 3 == 0:
                sample["seg.png"] = rng.bytes(100)
            sink.write(sample)
    archives = sorted(src.glob("*.tar"))
    runs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        summary = index_webdataset([str(src)], str(out), workers=workers, progress=False)
        assert (summary.samples, summary.archives, summary.skipped) == (20, 3, 0)
        runs.append(_files(out))
    assert runs[0] == runs[1]
    root = str(tmp_path / "out1")
    manifest = read_manifest(root)
    assert (manifest.kind, manifest.origin, manifest.members) == ("webdataset", "indexed", ("bin", "seg.png", "txt"))
    groups = [list(webdataset.tariterators.group_by_keys(webdataset.tariterators.tar_file_expander(
        [{"stream": open(a, "rb"), "url": str(a)}]))) for a in archives]
    for (shard, index), archive, expected in zip(indexed(root), archives, groups):
        assert shard.name == str(archive) and shard.bytes == archive.stat().st_size
        assert index.key_list() == [s["__key__"] for s in expected]
        where = {m.name: (m.offset_data - 512, m.size) for m in _members(archive)}
        for i, sample in enumerate(expected):
            exts = sorted(k for k in sample if not k.startswith("__"))
            assert index.sample_members(i) == sorted(((e, *where[f"{sample['__key__']}.{e}"]) for e in exts),
                                                     key=lambda m: m[1])
            assert all(len(sample[e]) == where[f"{sample['__key__']}.{e}"][1] for e in exts)
    assert main(["-q", "verify", root, "--allow-root", str(src)]) == 0 and "verify: OK" in capsys.readouterr().out
    with pytest.raises(ValueError, match="is decoded by your own function: pass decode=fn"):
        make_stream_loader(root, "train", batch_size=2, num_workers=0, allowed_roots=[str(src)])  # (decode= missing)


def test_webdataset_keys_that_are_not_sample_keys_are_skipped_and_named(tmp_path):
    archive = _tar(tmp_path / "a.tar", [("ok.txt", b"1"), ("dir/x.txt", b"2"), ("ok2.txt", b"3"), ("ok2.TXT", b"4"),
                                        ("ok.bin", b"5"), ("noext", b"6")])
    summary = index_webdataset([str(archive)], str(tmp_path / "out"), max_skipped=3, progress=False)
    assert summary.samples == 1 and summary.ignored == 1
    reasons = sorted(s["reason"] for s in summary.skip_list)
    assert len(reasons) == 3 and all(r.startswith(f"{archive}:") for r in reasons)
    assert any("invalid sample key 'dir/x'" in r for r in reasons)
    assert any("'ok2.TXT'" in r and "lowercase" in r for r in reasons)
    assert any("duplicate key 'ok'" in r for r in reasons)
    with pytest.raises(ShardstreamError, match="3 samples skipped, more than --max-skipped 2; nothing was written"):
        index_webdataset([str(archive)], str(tmp_path / "strict"), max_skipped=2, progress=False)
    assert not (tmp_path / "strict").exists()


def _indexed_copy(sa1b_src: pathlib.Path, tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    out = tmp_path / "data"
    shutil.copytree(sa1b_src, out)
    index_sa1b([str(out)], str(out), progress=False)
    return out, out / "sa_000000.tar"


def test_an_archive_changed_after_indexing_is_named(sa1b_src, tmp_path, capsys):
    out, archive = _indexed_copy(sa1b_src, tmp_path)
    original = archive.read_bytes()
    archive.write_bytes(original + b"\0" * 512)
    with pytest.raises(ShardError, match=r"sa_000000\.tar: sample .* shard is 92672 bytes, the manifest says 92160"):
        _by_key(str(out))
    assert main(["-q", "verify", str(out)]) == 1 and "sa_000000.tar: 92672 bytes, the manifest says" in capsys.readouterr().out
    changed = bytearray(original)
    jpg = next(m for m in _members(archive) if m.name.endswith(".jpg"))
    changed[jpg.offset_data + 100] ^= 0xFF
    archive.write_bytes(bytes(changed))
    with pytest.raises(ShardError, match=r"sa_000000\.tar: sample 'sa_\d+': content has SHA-256 .*, the manifest says"):
        _by_key(str(out), verify="sha256")
    assert main(["-q", "verify", str(out)]) == 1 and "sa_000000.tar: SHA-256" in capsys.readouterr().out
    archive.unlink()
    with pytest.raises(ShardError, match=r"sa_000000\.tar: sample .*: shard is missing"):
        _by_key(str(out))
    assert main(["-q", "verify", str(out)]) == 1 and "sa_000000.tar: shard is missing" in capsys.readouterr().out


def _hostile_originals(sa1b_src: pathlib.Path) -> dict[str, list[tuple[str, bytes]]]:
    key, jpg, meta = _pairs(sa1b_src)[0]
    parsed = json.loads(meta)
    return {
        "deep JSON": [(f"{key}.jpg", jpg), (f"{key}.json", b"[" * 100000 + b"]" * 100000)],
        "JSON not an object": [(f"{key}.jpg", jpg), (f"{key}.json", b"[1, 2]")],
        "invalid JSON": [(f"{key}.jpg", jpg), (f"{key}.json", b"{\"image\": ")],
        "JPEG of another size": [(f"{key}.jpg", jpg), (f"{key}.json", json.dumps(
            {**parsed, "image": {**parsed["image"], "width": parsed["image"]["width"] + 1}}).encode())],
        "truncated JPEG": [(f"{key}.jpg", jpg[: len(jpg) // 2]), (f"{key}.json", meta)],
        "image without JSON": [(f"{key}.jpg", jpg)],
        "member in a folder": [(f"x/{key}.jpg", jpg), (f"x/{key}.json", meta)],
        "unsafe key": [(f"..{key}.jpg", jpg), (f"..{key}.json", meta)],
    }


# What indexing makes of each hostile archive (beside a good one). Refused, by either kind (an archive
# whose structure cannot be read): what the InputError says after the archive's name.
_REFUSED = {
    "60 GB member claimed": "archive ends inside member",
    "100 GB base-256 size": "not a tar archive: invalid tar header at byte 0",
    "gzip bomb": "gzip-compressed archive; only uncompressed tar archives are indexed",
    "not a tar": "not a tar archive: invalid tar header at byte 0",
    "cut inside a member": "archive ends inside member",
}
# Indexed: per kind (sa1b, webdataset), (samples skipped, members ignored, the archive listed as a shard).
# The sa1b kind wants .jpg and .json (the packed corpus has .msgpack: no JSON); webdataset takes any
# members whose names are safe, and leaves their content to the reader.
_INDEXED = {
    "path traversal member": ((1, 0, False), (1, 0, False)),
    "path traversal key": ((1, 0, False), (1, 0, False)),
    "absolute member": ((1, 0, False), (0, 1, False)),
    "backslash member": ((0, 1, False), (1, 0, False)),
    "NUL in member name": ((1, 0, False), (1, 0, False)),
    "long member name": ((1, 0, False), (1, 0, False)),
    "symlink": ((1, 0, False), (1, 0, False)),
    "hardlink": ((1, 0, False), (1, 0, False)),
    "device": ((1, 0, False), (1, 0, False)),
    "truncated shard": ((1, 1, False), (0, 0, True)),
    "pixel bomb JPEG": ((1, 1, False), (0, 0, True)),
    "10k x 10k JPEG": ((1, 1, False), (0, 0, True)),
    "PNG pretending to be JPEG": ((1, 1, False), (0, 0, True)),
    "msgpack huge str length": ((1, 1, False), (0, 0, True)),
    "msgpack huge map": ((1, 1, False), (0, 0, True)),
    "msgpack deep nesting": ((1, 1, False), (0, 0, True)),
    "msgpack ext type": ((1, 1, False), (0, 0, True)),
    "pickle payload": ((1, 1, False), (0, 0, True)),
    "pickle member": ((1, 2, False), (0, 0, True)),
    "unknown field": ((1, 1, False), (0, 0, True)),
    "missing field": ((1, 1, False), (0, 0, True)),
    "missing member": ((1, 0, False), (0, 0, True)),
    "too many members": ((0, 17, False), (1, 0, False)),
    "manifest key disagrees": ((1, 1, False), (0, 0, True)),
    "deep JSON": ((1, 0, False), (0, 0, True)),
    "JSON not an object": ((1, 0, False), (0, 0, True)),
    "invalid JSON": ((1, 0, False), (0, 0, True)),
    "JPEG of another size": ((1, 0, False), (0, 0, True)),
    "truncated JPEG": ((1, 0, False), (0, 0, True)),
    "image without JSON": ((1, 0, False), (0, 0, True)),
    "member in a folder": ((2, 0, False), (1, 0, False)),
    "unsafe key": ((0, 2, False), (1, 0, False)),
    "empty": ((0, 0, False), (0, 0, False)),  # (an empty file: an archive of no members)
}


def test_hostile_archives_are_refused_or_skipped_with_the_archive_named(sa1b_src, sa1b_sample, tmp_path):
    good = sa1b_src / "sa_000001.tar"
    cases = {name: b"".join(raw for _, raw in samples) + (tail or b"")
             for name, (_, samples, tail, _) in _corpus(sa1b_sample).items()}
    for name, members in _hostile_originals(sa1b_src).items():
        cases[name] = _tar(tmp_path / "tmp.tar", members).read_bytes()
    cases["not a tar"] = b"hello" * 1000
    cases["cut inside a member"] = cases["deep JSON"][:1500]
    cases["empty"] = b""
    assert sorted(cases) == sorted([*_REFUSED, *_INDEXED]), "each case has its expected outcome"
    for case, data in cases.items():
        for number, (index, kind) in enumerate(((index_sa1b, "sa1b"), (index_webdataset, "webdataset"))):
            archive = tmp_path / f"{case.replace(' ', '-')}.tar"
            archive.write_bytes(data)
            out = tmp_path / f"out-{kind}-{archive.stem}"
            if case in _REFUSED:
                with pytest.raises(InputError) as refused:
                    index([str(archive), str(good)], str(out), max_skipped=100, progress=False)
                assert str(refused.value).startswith(f"{archive}: {_REFUSED[case]}"), f"{case}, {kind}: {refused.value}"
                assert not out.exists(), f"{case}, {kind}: nothing is written"
                continue
            summary = index([str(archive), str(good)], str(out), max_skipped=100, progress=False)
            skipped, ignored, listed = _INDEXED[case][number]
            assert (summary.skipped, summary.ignored) == (skipped, ignored), (case, kind, summary.skip_list)
            assert all(s["reason"].startswith(f"{archive}:") for s in summary.skip_list), (case, kind)
            assert read_manifest(str(out)).splits["train"].names == [str(archive)] * listed + [str(good)], (case, kind)
            assert {p.suffix for p in out.iterdir()} == {".idx", ".json"}, (case, kind)
            if kind == "sa1b":
                assert main(["-q", "verify", str(out), "--allow-root", str(sa1b_src)]) == 0, case
            archive.unlink()


def test_compressed_and_missing_archives_are_refused(sa1b_src, tmp_path):
    import gzip

    archive = tmp_path / "sa.tar"
    archive.write_bytes(gzip.compress((sa1b_src / "sa_000000.tar").read_bytes()))
    with pytest.raises(InputError, match=r"sa\.tar: gzip-compressed archive; only uncompressed"):
        index_sa1b([str(archive)], str(tmp_path / "out"), progress=False)
    assert main(["-q", "index", "sa1b", str(archive), str(tmp_path / "out")]) == 1, "a data problem"
    with pytest.raises(FileNotFoundError, match="missing.tar: not a .tar archive or a folder"):
        index_sa1b([str(tmp_path / "missing.tar")], str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "sa.tar.gz").write_bytes(b"")
    with pytest.raises(ShardstreamError, match=r"sa\.tar\.gz: a compressed archive"):
        index_sa1b([str(tmp_path / "sa.tar.gz")], str(tmp_path / "out"), progress=False)


def test_indexing_again_removes_only_the_earlier_runs_unlisted_indexes(sa1b_src, tmp_path):
    out = tmp_path / "data"
    index_sa1b([str(sa1b_src)], str(out), splits=SPLITS, progress=False)
    first = {p.name for p in out.glob("*.idx")}
    (out / "notes.idx").write_bytes(b"the user's own")  # listed by no manifest: never touched
    index_sa1b([str(sa1b_src)], str(out), splits=SPLITS, progress=False)  # the same run: the same files
    assert {p.name for p in out.glob("*.idx")} == first | {"notes.idx"}
    copy = shutil.copy(sa1b_src / "sa_000001.tar", tmp_path / "copy.tar")  # its keys twice: all skipped
    with pytest.raises(ShardstreamError, match="more than --max-skipped 0"):  # a failed run removes nothing
        index_sa1b([str(sa1b_src / "sa_000001.tar"), str(copy)], str(out), max_skipped=0, progress=False)
    assert {p.name for p in out.glob("*.idx")} == first | {"notes.idx"}
    index_sa1b([str(sa1b_src / "sa_000001.tar")], str(out), progress=False)  # another dataset in the same OUT
    listed = {shard.index.name for shard in read_manifest(str(out)).splits["train"]}
    assert {p.name for p in out.glob("*.idx")} == listed | {"notes.idx"} and not listed & first
    assert len(_by_key(str(out), allowed_roots=[str(sa1b_src)])) == 7


def test_a_run_past_max_skipped_stops_there_and_removes_what_it_wrote(sa1b_src, tmp_path):
    archives = [str(shutil.copy(sa1b_src / f"sa_00000{i}.tar", tmp_path / name))
                for i, name in ((0, "a.tar"), (0, "b.tar"), (1, "c.tar"))]  # b: a's keys again
    out = tmp_path / "out"
    with pytest.raises(ShardstreamError, match="7 samples skipped in the first 2 of 3 archives, more than --max-skip"):
        index_sa1b(archives, str(out), max_skipped=6, progress=False)
    assert not out.exists()  # a.tar's index was written, and removed
    summary = index_sa1b(archives, str(out), max_skipped=7, progress=False)
    assert (summary.samples, summary.skipped) == (14, 7)
    assert len(_by_key(str(out), allowed_roots=[str(tmp_path)])) == 14


@given(st.lists(st.lists(st.text(min_size=1, max_size=3), unique=True, max_size=40), max_size=12))
def test_keys_seen_are_told_apart_as_a_set_does(batches):
    keys, seen = SeenKeys(), set()
    for batch in batches:
        assert keys.add(batch).tolist() == [k not in seen for k in batch]
        seen.update(batch)
    assert len(keys) == len(seen)


def test_a_packed_dataset_is_never_overwritten(sa1b_src, sa1b_dataset, tmp_path):
    out = tmp_path / "packed"
    shutil.copytree(sa1b_dataset, out)
    with pytest.raises(ShardstreamError, match="holds a packed dataset"):
        index_sa1b([str(sa1b_src)], str(out), progress=False)


def test_a_shard_listed_twice_in_a_split_is_refused(sa1b_src, tmp_path):
    out = tmp_path / "out"
    index_sa1b([str(sa1b_src)], str(out), splits=SPLITS, progress=False)
    manifest = json.loads((out / "manifest.json").read_bytes())
    assert Manifest.from_json(json.dumps(manifest).encode(), "m").splits["val"].names == [
        str(sa1b_src / "sa_000000.tar"), str(sa1b_src / "sa_000001.tar")], "an archive serves both splits"
    shards = manifest["splits"]["train"]["shards"]
    shards["name"][1] = shards["name"][0]
    with pytest.raises(ShardstreamError, match="listed more than once"):
        Manifest.from_json(json.dumps(manifest).encode(), "m")
    for bad in ("../sa.tar", "a/../sa.tar", "/x/../sa.tar", "s3://b/../sa.tar", "sa.tgz"):
        shards["name"][1] = bad
        with pytest.raises(ShardstreamError, match="a shard entry of the wrong type or form"):
            Manifest.from_json(json.dumps(manifest).encode(), "m")


def test_index_archives_on_s3(server, sa1b_src, tmp_path):
    options = storage_options(server.endpoint)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = new_bucket(server)
    fs.put(str(sa1b_src) + "/", f"{bucket}/sa1b/", recursive=True)
    local = tmp_path / "local"
    index_sa1b([str(sa1b_src)], str(local), progress=False)
    expected = _by_key(str(local), allowed_roots=[str(sa1b_src)])
    # Archives on S3, dataset folder on local disk: the manifest names them by URL (read where allowed).
    out = tmp_path / "out"
    index_sa1b([f"s3://{bucket}/sa1b"], str(out), workers=2, progress=False, storage_options=options)
    assert read_manifest(str(out)).splits["train"].names == [f"s3://{bucket}/sa1b/sa_000000.tar",
                                                             f"s3://{bucket}/sa1b/sa_000001.tar"]
    with pytest.raises(ShardError, match=rf"s3://{bucket}/sa1b/sa_000000\.tar: the manifest of .* names a file outside "
                                         r"its folder; .*allowed_roots"):
        _by_key(str(out), storage_options=options)
    allowed = [f"s3://{bucket}/sa1b"]
    _assert_same(_by_key(str(out), storage_options=options, allowed_roots=allowed), expected)
    with pytest.raises(ShardError, match="verify='sha256' checks shards on local disk; this one is on object storage"):
        _by_key(str(out), storage_options=options, verify="sha256", allowed_roots=allowed)
    # Dataset folder on S3 beside its archives: named relative to it.
    remote = f"s3://{bucket}/sa1b"
    index_sa1b([remote], remote, progress=False, storage_options=options)
    assert read_manifest(remote, options).splits["train"].names == ["sa_000000.tar", "sa_000001.tar"]
    _assert_same(_by_key(remote, storage_options=options, num_workers=2), expected)
    _assert_same(_by_key(remote, storage_options=options, cache_dir=str(tmp_path / "cache"), cache_limit=1 << 30),
                 expected)


def test_hostile_json_in_an_indexed_archive_is_a_named_sample_error(sa1b_src, tmp_path):
    out, archive = _indexed_copy(sa1b_src, tmp_path)
    data = bytearray(archive.read_bytes())
    meta = next(m for m in _members(archive) if m.name.endswith(".json"))
    data[meta.offset_data : meta.offset_data + meta.size] = b"[" * meta.size  # same size: passes the size check
    archive.write_bytes(bytes(data))
    key = meta.name.removesuffix(".json")
    with pytest.raises(SampleError, match=rf"sa_000000\.tar: sample '{key}', field 'json': invalid JSON: JSON nested "
                                          "deeper than 32 levels"):
        _by_key(str(out))
    assert len(_by_key(str(out), on_error="skip")) == 13


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n\u00e9'),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[{"\\x'), inner, max_size=3),
                     max_leaves=60)


def _nesting(value) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(_nesting, children), default=0)


@given(_JSON, st.integers(1, 8))
def test_json_is_parsed_within_its_nesting_limit(value, limit):
    text = json.dumps(value, ensure_ascii=False).encode()
    if _nesting(value) <= limit:
        assert parse_json(text, max_depth=limit) == value
    else:
        with pytest.raises(ValueError, match=f"nested deeper than {limit} levels"):
            parse_json(text, max_depth=limit)
    with pytest.raises(ValueError, match="more than the limit"):
        parse_json(text, max_bytes=len(text) - 1)


def _rewrite_header(data: bytearray, offset: int, name: bytes | None = None, size: int | None = None) -> None:
    """A member header changed in place (name or size field), its checksum made valid again."""
    if name is not None:
        data[offset : offset + 100] = name.ljust(100, b"\0")
    if size is not None:
        data[offset + 124 : offset + 136] = b"%011o\0" % size
    data[offset + 148 : offset + 156] = b" " * 8
    data[offset + 148 : offset + 156] = b"%06o\0 " % sum(data[offset : offset + 512])


@pytest.mark.parametrize("change", ["name", "size"])
def test_a_member_header_that_disagrees_with_the_index_is_named(sa1b_src, tmp_path, change):
    out, archive = _indexed_copy(sa1b_src, tmp_path)
    data = bytearray(archive.read_bytes())
    jpg = next(m for m in _members(archive) if m.name.endswith(".jpg"))
    key = jpg.name.removesuffix(".jpg")
    if change == "name":
        _rewrite_header(data, jpg.offset_data - 512, name=f"{key}.png".encode())
        expected = rf"sa_000000\.tar: sample '{key}': the member at byte \d+ is not named {key}\.jpg, as the index says"
    else:
        _rewrite_header(data, jpg.offset_data - 512, size=jpg.size - 1)
        expected = rf"sa_000000\.tar: sample '{key}': member {key}\.jpg at byte \d+ claims {jpg.size - 1} bytes, the index says {jpg.size}"
    archive.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=expected):
        _by_key(str(out), shuffle=False)


def test_an_archive_of_more_extensions_than_an_index_holds_is_refused(tmp_path):
    archive = _tar(tmp_path / "many.tar", [(f"k{i}.e{i}", b"x") for i in range(300)])
    with pytest.raises(InputError, match=r"many\.tar: cannot be indexed: 300 distinct member extensions"):
        index_webdataset([str(archive)], str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_a_schema_3_dataset_reads_and_upgrades_to_4_with_its_indexes_unchanged(sa1b_dataset, tmp_path, capsys):
    root = tmp_path / "v3"
    shutil.copytree(sa1b_dataset, root)
    current = (root / "manifest.json").read_bytes()
    obj = json.loads(current)
    assert (obj.pop("origin"), obj.pop("members"), obj["schema_version"]) == ("packed", [], 4)
    (root / "manifest.json").write_text(json.dumps({**obj, "schema_version": 3}))
    assert read_manifest(str(root)).version == 3
    _assert_same(_by_key(str(root)), _by_key(sa1b_dataset))
    indexes = {n: d for n, d in _files(root).items() if n.endswith(".idx")}
    assert main(["-q", "upgrade", str(root)]) == 0 and "upgraded from schema 3 to 4: 0 shard indexes written" in \
        capsys.readouterr().out
    assert (root / "manifest.json").read_bytes() == current
    assert {n: d for n, d in _files(root).items() if n.endswith(".idx")} == indexes


def test_members_far_apart_on_s3_by_range_and_through_the_cache(server, sa1b_src, tmp_path):
    (key, jpg, meta), = _pairs(sa1b_src)[:1]
    archive = _tar(tmp_path / "apart.tar", [(f"{key}.jpg", jpg), ("filler.bin", bytes(3 << 20)), (f"{key}.json", meta)])
    local = tmp_path / "local"
    index_sa1b([str(archive)], str(local), progress=False)
    options = storage_options(server.endpoint)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = new_bucket(server)
    fs.put(str(archive), f"{bucket}/apart/apart.tar")
    remote = f"s3://{bucket}/apart"
    index_sa1b([remote], remote, progress=False, storage_options=options)
    expected = _by_key(str(local), batch_size=1, allowed_roots=[str(tmp_path)])
    _assert_same(_by_key(remote, storage_options=options, batch_size=1), expected)
    _assert_same(_by_key(remote, storage_options=options, batch_size=1, cache_dir=str(tmp_path / "cache"),
                         cache_limit=1 << 30), expected)


def test_index_says_when_its_dataset_needs_allowed_roots(sa1b_src, tmp_path, capsys):
    """Archives outside OUT (or linked from inside it to elsewhere): the loader reads them only where
    the user allows, and `shard-pack index` says so, with the roots to allow."""
    assert main(["-q", "index", "sa1b", str(sa1b_src), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"make_stream_loader(..., allowed_roots=['{sa1b_src}']), shard-pack verify/tune/preview --allow-root " \
           f"{sa1b_src}" in said, said
    assert main(["-q", "verify", str(tmp_path / "out"), "--allow-root", str(sa1b_src)]) == 0
    inside = tmp_path / "inside"
    shutil.copytree(sa1b_src, inside / "archives")
    assert main(["-q", "index", "sa1b", str(inside / "archives"), str(inside)]) == 0
    assert "allowed_roots" not in capsys.readouterr().out
    linked = tmp_path / "linked"
    (linked / "archives").mkdir(parents=True)
    (linked / "archives" / "sa_000000.tar").symlink_to(sa1b_src / "sa_000000.tar")
    assert main(["-q", "index", "sa1b", str(linked / "archives"), str(linked)]) == 0
    assert f"allowed_roots=['{sa1b_src}']" in capsys.readouterr().out
    assert len(_by_key(str(linked), allowed_roots=[str(sa1b_src)])) == 7


_INDEX_ODD = """
import json, sys
from shard_tools.index import index_sa1b
summary = index_sa1b([sys.argv[1]], sys.argv[2], progress=False)
print(json.dumps([summary.samples, summary.skipped, [s["reason"] for s in summary.skip_list]]))
"""


def test_a_fifo_or_a_device_among_the_archives_is_skipped_and_counted(sa1b_src, tmp_path):
    """Before: `shard-pack index` waited forever on a FIFO named .tar, and read a link to /dev/zero
    forever (100% CPU)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(sa1b_src / "sa_000000.tar", src / "a.tar")
    os.mkfifo(src / "b.tar")
    (src / "c.tar").symlink_to("/dev/zero")
    out, err = run_bounded([sys.executable, "-c", _INDEX_ODD, str(src), str(tmp_path / "out")], 60,
                           "shard-pack index hung on a FIFO or a device")
    samples, skipped, reasons = json.loads(out.splitlines()[-1])
    assert (samples, skipped) == (7, 2), err
    assert reasons == [f"{src}/b.tar: {src}/b.tar is a FIFO, not a regular file: a dataset's shards and index files, "
                       "and archives to index, must be regular files",
                       f"{src}/c.tar: {src}/c.tar (a symlink to /dev/zero) is a character device, not a regular file: "
                       "a dataset's shards and index files, and archives to index, must be regular files"]


def test_an_s3_dataset_naming_a_local_path_reads_neither_the_bucket_nor_the_disk(server, sa1b_src, tmp_path):
    """`posixpath.join(root, "/abs")` drops the root: a dataset at s3://bucket/data naming /victim/x.tar
    read bucket `victim` with the user's options, reporting a local-looking path. Refused now."""
    options = storage_options(server.endpoint)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket, victim = f"t{uuid.uuid4().hex[:12]}", f"v{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.mkdir(victim)
    fs.put(str(sa1b_src / "sa_000000.tar"), f"{victim}/sa_000000.tar")
    fs.put(str(sa1b_src / "sa_000000.tar"), f"{bucket}/data/sa_000000.tar")
    remote = f"s3://{bucket}/data"
    index_sa1b([remote], remote, progress=False, storage_options=options)
    manifest = json.loads(fs.cat_file(f"{bucket}/data/manifest.json"))
    manifest["splits"]["train"]["shards"]["name"] = [f"/{victim}/sa_000000.tar"]
    fs.pipe_file(f"{bucket}/data/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(ShardError, match=rf"/{victim}/sa_000000\.tar: the manifest of {remote} names a file outside its "
                                         "folder"):
        _by_key(remote, storage_options=options)
