"""Shared fixtures: small SA-1B-shaped datasets built from real photographs, packed by the project."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import tarfile
import uuid
from typing import Any

import pytest
from hypothesis import settings

from pipeline.format import ShardIndex, ShardInfo
from pipeline.storage import filesystem, read_index, read_manifest, shard_indexes

from shard_tools.pack import PackOptions, pack
from shard_tools.sa1b import Sa1bSource
from shard_tools.samples.locals3 import AWS_ENV, SeaweedFS, storage_options
from shard_tools.samples.sa1b import write_sa1b

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
    shard, index = indexed(sa1b_dataset)[0]
    data = pathlib.Path(sa1b_dataset, shard.name).read_bytes()
    start, end = index.span(0)
    raw = data[start:end]
    with tarfile.open(fileobj=io.BytesIO(raw + b"\0" * 1024)) as archive:
        jpg, ann = (archive.extractfile(m).read() for m in archive.getmembers())
    return index.key(0), raw, jpg, ann


def sa1b_originals(sa1b_src: pathlib.Path) -> dict[str, tuple[dict[str, Any], bytes]]:
    """Each SA-1B sample's annotations (parsed JSON) and JPEG bytes, by key, from the source archives."""
    found: dict[str, dict[str, bytes]] = {}
    for path in sorted(sa1b_src.glob("*.tar")):
        with tarfile.open(path) as archive:
            for member in archive:
                key, ext = member.name.split(".")
                found.setdefault(key, {})[ext] = archive.extractfile(member).read()  # type: ignore[union-attr]
    return {key: (json.loads(m["json"]), m["jpg"]) for key, m in found.items()}


def batches_of(loader: Any, epoch: int = 1, stop: int | None = None) -> list[Any]:
    """The batches a loader yields for `epoch`, or its first `stop` (the iteration left open there)."""
    loader.set_epoch(epoch)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == stop:
            break
    return batches


def indexed(root: str, split: str = "train", **storage: Any) -> list[tuple[ShardInfo, ShardIndex]]:
    """Each shard of a split with its index (keys, spans, units)."""
    return list(shard_indexes(root, read_manifest(root, storage or None), split, storage or None))


def index_of(root: str, shard: ShardInfo) -> ShardIndex:
    fs, base = filesystem(root)
    return read_index(fs, base, root, shard)


def split_keys(root: str, split: str = "train") -> list[str]:
    """Every key of a split of a local dataset, in shard order, read without the project's own readers:
    the manifest's JSON names the split's shards (relative to `root`, or absolute), and each shard's tar
    members, read by `tarfile`, name its samples (a key is a member's name up to the first dot of its
    base name; a sample's members come together). Archives indexed in place list the samples of every
    split: a key is the split's as the packer splits keys (`_split_of`), once, in its first archive."""
    manifest = json.loads(pathlib.Path(root, "manifest.json").read_bytes())
    indexed_in_place = manifest.get("origin") == "indexed"
    keys: list[str] = []
    for name in manifest["splits"][split]["shards"]["name"]:
        with tarfile.open(pathlib.Path(root, name)) as archive:
            for member in archive:
                folder, _, base = member.name.rpartition("/")
                key, _, ext = base.partition(".")
                key = f"{folder}/{key}" if folder else key
                if not member.isfile() or (keys and keys[-1] == key):
                    continue
                if indexed_in_place and (ext not in manifest["members"] or key in keys or
                                         _split_of(key, manifest["options"]["splits"]) != split):
                    continue
                keys.append(key)
    return keys


def _split_of(key: str, splits: list[list[Any]]) -> str:
    """The split of a key, as `shard-pack` documents it: the key's blake2b-64 (big-endian) over 2**64
    against the splits' cumulative fractions (the last split past them all)."""
    u, bound = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64, 0.0
    for name, fraction in splits:
        bound += fraction
        if u < bound:
            return name
    return splits[-1][0]


def split_units(root: str, split: str = "train") -> list[tuple[str, int]]:
    """(key, units) of every sample of a split, in shard order."""
    return [(key, int(u)) for _, index in indexed(root, split) for key, u in zip(index.key_list(), index.units)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A SeaweedFS S3 server on 127.0.0.1 for the module's tests (explicit credentials; no metadata probes)."""
    os.environ.update({k: v for k, v in AWS_ENV.items() if k == "AWS_EC2_METADATA_DISABLED"})
    weed = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    weed.start()
    yield weed
    weed.stop()


def new_bucket(server: SeaweedFS) -> str:
    """A new empty bucket on the server: its name."""
    import s3fs

    name = f"t{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**storage_options(server.endpoint), skip_instance_cache=True).mkdir(name)
    return name


@pytest.fixture(scope="session")
def vqa(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SLAKE-layout split "train": 8 images, 1 to 5 questions each, 3 images per shard."""
    from shard_tools.samples.vqa import write_vqa
    from shard_tools.vqa import VqaSource, pack_vqa

    root = tmp_path_factory.mktemp("vqa-small")
    files = write_vqa(root / "src", "slake", {"train": 8}, per_image=(1, 5), seed=0)
    source = VqaSource(str(root / "src" / "images"), tuple((name, str(file)) for name, file in files.items()))
    pack_vqa(source, str(root / "out"), PackOptions(shard_samples=3), progress=False)
    return str(root / "out")


@pytest.fixture(scope="session")
def emb(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An embeddings split "train" of 23 rows in blocks of 4."""
    import json

    import numpy as np

    from shard_tools.embeddings import pack_embeddings

    src = tmp_path_factory.mktemp("emb-small-src")
    np.save(src / "x.npy", np.arange(23 * 3, dtype=np.float32).reshape(23, 3))
    (src / "schema.json").write_text(json.dumps({"fields": {"x": {"file": "x.npy"}}}))
    out = tmp_path_factory.mktemp("emb-small")
    pack_embeddings(str(src), str(out), rows_per_block=4, progress=False)
    return str(out)
