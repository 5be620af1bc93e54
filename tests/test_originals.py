"""Every loader guarantee over original SA-1B archives indexed in place: exactly once over ranks x
workers, resumption (same world and elastic), mixing with a packed dataset, members far apart,
and the read limits."""

from __future__ import annotations

import collections
import io
import json
import math
import shutil
import tarfile

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline import make_stream_loader
from pipeline.errors import SampleError, ShardError
from pipeline.kinds.sa1b import annotation_arrays
from pipeline.index import MEMBER_GAP, member_ranges
from pipeline.tario import ReadLimits
from shard_tools.index import index_sa1b
from conftest import batches_of, split_keys

SMALL = dict(image_size=48, mask_size=16, max_masks=3)
SPLITS = (("train", 0.7), ("val", 0.3))


@pytest.fixture(scope="module")
def originals(sa1b_src, tmp_path_factory) -> str:
    """The archives indexed where they are, in the dataset's folder (named relative to it)."""
    out = tmp_path_factory.mktemp("originals")
    shutil.copytree(sa1b_src, out / "archives")
    index_sa1b([str(out / "archives")], str(out), splits=SPLITS, progress=False)
    return str(out)


def _loader(root, **kw):
    return make_stream_loader(root, "train", **{"batch_size": 2, "num_workers": 0, "seed": 5, **SMALL, **kw})




def _assert_same(got, expected):
    assert [b["keys"] for b in got] == [b["keys"] for b in expected] and got
    for a, b in zip(got, expected):
        assert all(torch.equal(a[name], b[name]) for name in a if name != "keys")


def test_every_sample_once_over_ranks_and_workers(originals):
    seen = [k for rank in range(2) for b in batches_of(_loader(originals, rank=rank, world_size=2, num_workers=2,
                                                             drop_last=False)) for k in b["keys"]]
    assert sorted(seen) == sorted(split_keys(originals))


@pytest.mark.parametrize("stop", [1, 3])
def test_resume_equals_uninterrupted(originals, stop):
    full = batches_of(_loader(originals))
    first = _loader(originals, num_workers=2)
    batches_of(first, stop=stop)
    resumed = _loader(originals, num_workers=2)
    resumed.load_state_dict(first.state_dict())
    _assert_same(batches_of(resumed), full[stop:])


def test_elastic_resume_two_ranks_to_one(originals):
    before = [_loader(originals, rank=r, world_size=2, drop_last=False) for r in range(2)]
    seen = [k for loader in before for b in batches_of(loader, stop=1) for k in b["keys"]]
    after = _loader(originals, rank=0, world_size=1, drop_last=False, num_workers=2)
    after.load_state_dict(before[0].state_dict())
    seen += [k for b in batches_of(after) for k in b["keys"]]
    assert sorted(seen) == sorted(split_keys(originals))


def test_mixed_with_a_packed_dataset_of_the_same_kind(originals, sa1b_dataset):
    loader = _loader([originals, sa1b_dataset], num_workers=2, drop_last=False, batch_size=3)
    samples = collections.defaultdict(list)
    for batch in batches_of(loader):
        for i, key in enumerate(batch["keys"]):
            samples[key].append(batch["images"][i])
    assert sorted(samples) == sorted(split_keys(originals)) and {len(v) for v in samples.values()} == {2}
    assert all(torch.equal(*images) for images in samples.values()), "a key's image alike from either source"


def test_read_limits_apply_to_originals(originals):
    with pytest.raises(ShardError, match=r"sa_00000\d\.tar: sample 'sa_\d+': member sa_\d+\.jpg at byte \d+ claims \d+ bytes, "
                                         r"the index says \d+ \(or beyond the cap"):
        batches_of(_loader(originals, limits=ReadLimits(max_member_bytes=1000)))
    with pytest.raises(ShardError, match=r"sa_00000\d\.tar: sample 'sa_\d+': spans \d+ bytes, more than max_sample_bytes=2000"):
        batches_of(_loader(originals, limits=ReadLimits(max_sample_bytes=2000)))
    with pytest.raises(ShardError, match=r"sa_00000\d\.tar: sample 'sa_\d+': more than 1 members"):
        batches_of(_loader(originals, limits=ReadLimits(max_members=1)))
    with pytest.raises(SampleError, match=r"sa_00000\d\.tar: sample 'sa_\d+', field 'image': invalid size 96x144"):
        batches_of(_loader(originals, limits=ReadLimits(max_image_pixels=100)))
    loader = _loader(originals, limits=ReadLimits(max_image_pixels=100), on_error="skip", drop_last=False)
    with pytest.raises(ShardError, match="all 2 samples of batch 0 failed"):
        batches_of(loader)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_members_far_apart_are_read_by_their_own_ranges(sa1b_src, tmp_path):
    with tarfile.open(sa1b_src / "sa_000000.tar") as tar:
        files = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]
    archive = tmp_path / "apart.tar"
    with tarfile.open(archive, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (name, data) in enumerate(files):  # each sample's jpg and json 2 MiB apart, but the last's
            _add(tar, name, data)
            if i < len(files) - 2 and name.endswith(".jpg"):
                _add(tar, f"filler{i}.bin", bytes(2 * MEMBER_GAP))
    index_sa1b([str(archive)], str(tmp_path / "apart"), progress=False)
    index_sa1b([str(sa1b_src / "sa_000000.tar")], str(tmp_path / "plain"), progress=False)
    settings = dict(shuffle=False, drop_last=False, allowed_roots=[str(tmp_path), str(sa1b_src)])  # (archives outside)
    apart, plain = (batches_of(_loader(str(tmp_path / name), **settings)) for name in ("apart", "plain"))
    _assert_same(apart, plain)
    # A sample 4 MiB wide reads its own bytes only: the limit counts what is read.
    size = max(len(data) for _, data in files) * 2 + 4096
    assert len(batches_of(_loader(str(tmp_path / "apart"), limits=ReadLimits(max_sample_bytes=size), **settings))) == 4


def test_member_ranges():
    near = ("jpg", 0, 1000)  # (its header, 1000 bytes, 24 of padding: 1536 bytes)
    far = ("json", 1536 + MEMBER_GAP - 1, 10)
    assert member_ranges([near, far]) == [(0, 1536 + MEMBER_GAP - 1 + 1024, [near, far])]
    farther = ("json", 1536 + MEMBER_GAP, 10)
    assert member_ranges([near, farther]) == [(0, 1536, [near]), (1536 + MEMBER_GAP, 2560 + MEMBER_GAP, [farther])]
    assert member_ranges([near, farther], gap=1 << 30) == [(0, 2560 + MEMBER_GAP, [near, farther])]


_VALUES = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([2**1100, -(2**1100)]), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                    st.none(), st.text(max_size=2), st.lists(st.floats(-10, 10), max_size=3))


@given(st.sampled_from(["area", "predicted_iou", "stability_score", "id"]), st.integers(0, 2), _VALUES)
def test_annotation_checks_refuse_and_keep_values_as_packing_always_did(sa1b_src, name, i, value):
    """Each annotation's field is taken as its number, or refused naming that annotation's field."""
    with tarfile.open(sa1b_src / "sa_000000.tar") as tar:
        meta = json.loads(tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith(".json"))).read())
    meta["annotations"][i][name] = value
    numeric = (type(value) is int and (-(2**63) <= value < 2**63 if name == "id" else abs(value) < 2**1023)) or \
        (type(value) is float and name != "id" and math.isfinite(value))
    if not numeric:
        with pytest.raises(SampleError, match=rf"field 'annotations\[{i}\]\.{name}'"):
            annotation_arrays(meta, "m", "k")
        return
    record, _, _ = annotation_arrays(meta, "m", "k")
    column = record["ids" if name == "id" else name]
    assert column[i] == (value if name == "id" else float(value)) and column.dtype == (np.int64 if name == "id" else np.float64)
