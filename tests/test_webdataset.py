"""The `webdataset` kind: tars written by `webdataset.ShardWriter`, indexed in place and streamed with
the user's own `decode` (and `collate`)."""

from __future__ import annotations

import collections
import io
import tarfile

import numpy as np
import pytest
import torch
import webdataset

from pipeline import make_stream_dataset, make_stream_loader, validate_first_batch
from pipeline.errors import SampleError, ShardError, ShardstreamError
from shard_tools.cli import main
from shard_tools.index import index_webdataset

SAMPLES = 23
BAD = {"s0003", "s0011"}  # samples `fragile` refuses


def decode(members: dict) -> dict:
    """A user's decode, as a webdataset pipeline's map would be: members are bytes, the key beside them."""
    assert all(isinstance(v, bytes) for k, v in members.items() if not k.startswith("__"))
    return {"key": members["__key__"], "label": int(members["cls"]), "text": members["txt"].decode(),
            "data": torch.frombuffer(bytearray(members["bin"]), dtype=torch.uint8)[:4].clone()}


def fragile(members: dict) -> dict:
    if members["__key__"] in BAD:
        raise ValueError(f"cannot decode label {members['cls'].decode()}")
    return decode(members)


def pairs(samples: list) -> tuple:
    """A custom collate: (keys, labels as one tensor)."""
    return [s["key"] for s in samples], torch.tensor([s["label"] for s in samples])


def clumsy(samples: list) -> dict:
    raise RuntimeError("shapes differ")


@pytest.fixture(scope="module")
def wds(tmp_path_factory) -> str:
    """20+ samples in 4 tars written by webdataset's own ShardWriter, indexed in place (train only), the
    dataset's folder theirs (so its names are relative to it)."""
    src = tmp_path_factory.mktemp("wds-src")
    rng = np.random.default_rng(3)
    with webdataset.ShardWriter(str(src / "part-%03d.tar"), maxcount=6, verbose=0) as sink:
        for i in range(SAMPLES):
            sink.write({"__key__": f"s{i:04d}", "cls": i, "txt": f"caption {i}", "bin": rng.bytes(4 + i * 37)})
    index_webdataset([str(src)], str(src), progress=False)
    return str(src)


def _keys(root: str, **settings) -> list[str]:
    loader = make_stream_loader(root, "train", **{"batch_size": 4, "num_workers": 0, "drop_last": False,
                                                  "decode": decode, **settings})
    return [k for batch in loader for k in batch["key"]]


def test_every_sample_once_across_ranks_and_workers_with_default_collate(wds):
    seen = []
    for rank in range(2):
        loader = make_stream_loader(wds, "train", batch_size=4, num_workers=2, rank=rank, world_size=2,
                                    drop_last=False, decode=decode, seed=1)
        for batch in loader:
            assert sorted(batch) == ["data", "key", "label", "text"]
            assert batch["label"].dtype == torch.int64 and batch["data"].shape == (len(batch["key"]), 4)
            assert batch["text"] == [f"caption {int(i)}" for i in batch["label"]]
            assert batch["key"] == [f"s{int(i):04d}" for i in batch["label"]]
            seen += batch["key"]
    assert sorted(seen) == [f"s{i:04d}" for i in range(SAMPLES)]


def test_the_same_keys_give_the_same_batches_in_any_worker_layout(wds):
    assert _keys(wds, seed=4) == _keys(wds, seed=4, num_workers=2) != _keys(wds, seed=5)


def test_a_custom_collate_and_spawned_workers(wds):
    loader = make_stream_loader(wds, "train", batch_size=5, num_workers=2, multiprocessing_context="spawn",
                                drop_last=False, decode=decode, collate=pairs)
    batches = list(loader)
    assert all(isinstance(b, list) and b[1].dtype == torch.int64 for b in batches), "(a tuple: a list, as torch's " \
        "DataLoader hands sequences over)"
    assert sorted(k for keys, _ in batches for k in keys) == [f"s{i:04d}" for i in range(SAMPLES)]
    with pytest.raises(ValueError, match="multiprocessing_context='spawn' sends the dataset to the workers by "
                                         "pickle.*not a lambda"):
        make_stream_loader(wds, "train", batch_size=5, num_workers=2, multiprocessing_context="spawn",
                           decode=lambda m: m)
    assert len(list(make_stream_loader(wds, "train", batch_size=5, num_workers=2, decode=lambda m: 1))) == 4, \
        "forked workers take any function"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_decode_that_raises_is_named_with_shard_and_key(wds, workers):
    with pytest.raises(SampleError, match=r"part-00\d\.tar: sample 's00(03|11)': decode raised ValueError: cannot "
                                          r"decode label (3|11)") as info:
        _keys(wds, decode=fragile, num_workers=workers, shuffle=False)
    if not workers:
        assert isinstance(info.value.__cause__, ValueError), "the user's exception chained"
    loader = make_stream_loader(wds, "train", batch_size=4, num_workers=workers, drop_last=False, decode=fragile,
                                on_error="skip")
    assert sorted(k for batch in loader for k in batch["key"]) == sorted({f"s{i:04d}" for i in range(SAMPLES)} - BAD)
    assert loader.skipped == 2
    with pytest.raises(ShardError, match="2 samples skipped in this epoch, more than max_errors=1"):
        _keys(wds, decode=fragile, num_workers=workers, on_error="skip", max_errors=1)


def test_a_collate_that_raises_names_the_batch(wds):
    with pytest.raises(ShardstreamError, match=r"collate raised RuntimeError on the batch of samples .*part-00\d\.tar:"
                                               r"s00\d\d, .*: shapes differ"):
        _keys(wds, collate=clumsy)


def test_decode_is_required_here_and_refused_elsewhere(wds, sa1b_dataset):
    with pytest.raises(ValueError, match="decoded by your own function: pass decode=fn"):
        make_stream_loader(wds, "train", batch_size=4)
    with pytest.raises(ValueError, match="decode must be a function"):
        make_stream_loader(wds, "train", batch_size=4, decode="jpg")
    with pytest.raises(ValueError, match="decode= and collate= are for webdataset datasets .* sa1b datasets are "
                                         "decoded by their kind"):
        make_stream_loader(sa1b_dataset, "train", batch_size=4, decode=decode)


def test_first_batch_rows_and_verify(wds, capsys):
    loader = make_stream_loader(wds, "train", batch_size=4, decode=decode)
    assert validate_first_batch(loader)["label"].shape == (4,)
    rows = list(make_stream_dataset(wds, "train", batch_size=4, drop_last=False, decode=decode, flatten=True))
    assert collections.Counter(r["key"] for r in rows) == {f"s{i:04d}": 1 for i in range(SAMPLES)}
    assert all(r["text"] == f"caption {int(r['label'])}" and r["data"].shape == (4,) for r in rows)
    with pytest.raises(ValueError, match="flatten needs batches that are a dict of tensors and lists.*makes a tuple"):
        list(make_stream_dataset(wds, "train", batch_size=4, decode=decode, collate=pairs, flatten=True))
    assert main(["-q", "verify", wds]) == 0 and "verify: OK" in capsys.readouterr().out


def test_resume_equals_uninterrupted(wds):
    def loader():
        return make_stream_loader(wds, "train", batch_size=3, num_workers=2, decode=decode, seed=8)

    full = [b["key"] for b in loader()]
    first = loader()
    it = iter(first)
    taken = [next(it)["key"], next(it)["key"]]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert taken + [b["key"] for b in resumed] == full


def _member(archive: tarfile.TarFile, name: str, data: bytes = b"x", pax: dict | None = None,
            type_: bytes = tarfile.REGTYPE) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.type = (len(data) if type_ == tarfile.REGTYPE else 0), type_
    info.pax_headers = pax or {}
    archive.addfile(info, io.BytesIO(data) if type_ == tarfile.REGTYPE else None)


@pytest.mark.parametrize("form", ["gnu", "pax"])
def test_every_member_is_a_sample_part_a_counted_skip_or_ignored(tmp_path, form):
    """Extended headers (a GNU long name, pax path, size and long name) make a member a skip each,
    counted and named whole, never an ignored member nor part of the next sample; what is ignored is
    a folder and a file with no extension, each counted."""
    long = "x" * 146 + ".txt"  # (150 characters: only an extended header holds it)
    with tarfile.open(tmp_path / "a.tar", "w", format=tarfile.GNU_FORMAT if form == "gnu" else tarfile.PAX_FORMAT) as t:
        for key in ("a", "b"):
            _member(t, f"{key}.txt", b"text")
            _member(t, f"{key}.cls", b"1")
        _member(t, long)
        if form == "pax":
            _member(t, "c.txt", pax={"path": "c.txt"})
            _member(t, "d.txt", pax={"size": "1"})
        _member(t, "folder", type_=tarfile.DIRTYPE)
        _member(t, "README")
        _member(t, "e.lnk", type_=tarfile.SYMTYPE)
    summary = index_webdataset([str(tmp_path / "a.tar")], str(tmp_path / "out"), progress=False)
    skipped = sorted(entry["key"] for entry in summary.skip_list)
    want = sorted(["e", "x" * 100 + "... (146 characters)"] + (["c", "d"] if form == "pax" else []))
    assert (summary.samples, summary.skipped, summary.ignored, skipped) == (2, len(want), 2, want)
    members = len(tarfile.open(tmp_path / "a.tar").getmembers())
    assert 2 * 2 + summary.skipped + summary.ignored == members  # (each skipped sample here: one member)


def test_outputs_written_from_a_loop_attach_to_each_sample(wds, tmp_path):
    """(pipeline.OutputWriter and attach=, as for the project's own kinds: docs/distillation.md.)"""
    from pipeline import OutputWriter

    out = str(tmp_path / "scores")
    settings = {"decode": decode, "drop_last": False}
    loader = make_stream_loader(wds, "train", batch_size=5, **settings)
    with OutputWriter(out, loader) as writer:
        for batch in loader:
            writer.write(batch["key"], {"score": batch["label"] * 2, "upper": [t.upper() for t in batch["text"]]})
    student = make_stream_loader(wds, "train", batch_size=3, num_workers=2, attach={"score": out, "upper": out},
                                 **settings)
    keys = []
    for batch in student:
        assert torch.equal(batch["score"], batch["label"] * 2) and batch["upper"] == [t.upper() for t in batch["text"]]
        keys += batch["key"]
    assert sorted(keys) == [f"s{i:04d}" for i in range(SAMPLES)]
