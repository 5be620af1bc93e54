"""Shared fixtures: small SA-1B-shaped datasets built from real photographs, packed by the project."""

from __future__ import annotations

import io
import logging
import os
import pathlib
import tarfile

import pytest
from hypothesis import settings

from pipeline.format import Manifest

from shard_tools.pack import PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.sample_data import write_sa1b

IMAGES = 14

# `make fuzz` runs the fuzz tests longer: HYPOTHESIS_PROFILE=fuzz
settings.register_profile("fuzz", max_examples=20000, deadline=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def sa1b_src(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """SA-1B as released: two tar archives of sa_<id>.jpg + sa_<id>.json."""
    out = tmp_path_factory.mktemp("sa1b-src")
    write_sa1b(out, images=IMAGES, size=(96, 144), masks=(3, 24), images_per_archive=7, seed=1)
    return out


@pytest.fixture(scope="session")
def sa1b_dataset(sa1b_src: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Packed shards: splits train/val, 3 samples per shard (so several shards per split)."""
    out = tmp_path_factory.mktemp("sa1b-shards")
    options = PackOptions(shard_samples=3, splits=(("train", 0.7), ("val", 0.3)), workers=1)
    pack(Sa1bSource(), [str(sa1b_src)], str(out), options, progress=False)
    return str(out)


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)


@pytest.fixture(scope="session")
def sa1b_sample(sa1b_dataset: str) -> tuple[str, bytes, bytes, bytes]:
    """One valid packed sample: its key, its raw bytes in the shard, its jpg and msgpack members."""
    manifest = Manifest.from_json(pathlib.Path(sa1b_dataset, "manifest.json").read_bytes(), "m")
    shard = manifest.splits["train"][0]
    data = pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    raw = data[shard.offsets[0] : shard.offsets[1]]
    with tarfile.open(fileobj=io.BytesIO(raw + b"\0" * 1024)) as archive:
        jpg, ann = (archive.extractfile(m).read() for m in archive.getmembers())
    return shard.keys[0], raw, jpg, ann
