"""Sidecars of outputs (`pipeline.OutputWriter`, `attach=`) on object storage, against the emulators
the suite starts on 127.0.0.1 (SeaweedFS for s3://, fake-gcs-server for gs://, Azurite for az://):
a sidecar written straight to a bucket by 2 ranks is the one a local write makes, byte for byte;
attached to the dataset on local disk, or to its copy in the bucket read by range or through the
shard cache, with 0 or 2 workers, each sample gets the teacher's output of that very sample, bit
for bit; and a write interrupted there and started again equals an uninterrupted one, object for
object (the listing and commit logic: an interruption mid-chunk, a chunk without its commit, the
epoch's indexes and manifest not written yet); a linked sidecar (`shard-pack link`) in the bucket
attaches each sample's row of an embeddings dataset there, by range or through the cache."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import OutputWriter, make_stream_loader
from pipeline.errors import DatasetError
from pipeline.storage import filesystem
from shard_tools.link import link
from shard_tools.samples import localazure, localgcs, locals3
from conftest import new_bucket, split_keys
from test_link import pack_vectors, vector
from test_outputs import AUGMENTED, teacher

os.environ.update({k: v for k, v in locals3.AWS_ENV.items() if k == "AWS_EC2_METADATA_DISABLED"})
os.environ.update(localgcs.GCS_ENV)  # (before google-auth is imported: it reads NO_GCE_CHECK once)

EPOCHS = (0, 1)
WORLD = 2


@dataclasses.dataclass(frozen=True)
class Store:
    """A bucket (an Azure container) on one emulator, and the options that reach it."""

    scheme: str
    bucket: str
    options: dict[str, Any]

    def url(self, name: str) -> str:
        return f"{self.scheme}://{self.bucket}/{name}"

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under `url`, by its name below it."""
        fs, base = filesystem(url, self.options)
        return {path.removeprefix(base + "/"): fs.cat_file(path) for path in fs.find(base)}


@pytest.fixture(scope="module", params=["s3", "gs", "az"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A new bucket on the scheme's emulator (one emulator per module; Azurite's tests skip, saying
    why, where it could not be installed)."""
    if request.param == "s3":
        server = request.getfixturevalue("server")
        yield Store("s3", new_bucket(server), locals3.storage_options(server.endpoint))
        return
    if request.param == "gs":
        gcs = localgcs.FakeGCS(tmp_path_factory.mktemp("fake-gcs"))
        gcs.start()
        try:
            options = localgcs.storage_options(gcs.endpoint)
            bucket = f"t{uuid.uuid4().hex[:12]}"
            filesystem(f"gs://{bucket}", options)[0].mkdir(bucket)
            yield Store("gs", bucket, options)
        finally:
            gcs.stop()
        return
    why = localazure.unavailable()
    if why is not None:
        pytest.skip(why)
    azurite = localazure.Azurite(tmp_path_factory.mktemp("azurite"))
    azurite.start()
    try:
        yield Store("az", azurite.new_container(), localazure.storage_options(azurite.endpoint))
    finally:
        azurite.stop()


@pytest.fixture(autouse=True)
def _no_cloud_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the options say where and who (as in test_storage_gcs and test_storage_azure)."""
    for name in [n for n in os.environ if n.startswith(("GOOGLE_", "GCSFS_", "AZURE", "AZURITE"))
                 or n == "STORAGE_EMULATOR_HOST"]:
        monkeypatch.delenv(name)


def _write(out: str, dataset: str, storage_options: dict[str, Any] | None, epochs: tuple[int, ...] = EPOCHS,
           world: int = WORLD, batch_size: int = 3, chunk_bytes: int = 2000, workers: int = 0, stop: int = 0) -> int:
    """The teacher's outputs (and a caption) of `dataset`'s train split written to `out`, epoch by
    epoch, one rank after the other, the loader's batches from `workers` processes: the batches
    written; `stop`: `Interrupted` raised out of the writer's block once that many are."""
    written = 0
    for epoch in epochs:
        for rank in range(world):
            loader = make_stream_loader(dataset, "train", batch_size=batch_size, drop_last=False, seed=5, rank=rank,
                                        world_size=world, num_workers=workers, **AUGMENTED)
            loader.set_epoch(epoch)
            try:
                with OutputWriter(out, loader, inputs=("images",), chunk_bytes=chunk_bytes,
                                  storage_options=storage_options) as writer:
                    for batch in loader:
                        writer.write(batch["keys"], {"teacher": teacher(batch["images"]),
                                                     "caption": [f"of {k}" for k in batch["keys"]]})
                        written += 1
                        if written == stop:
                            raise Interrupted(written)
            finally:
                loader.close()  # (its persistent workers ended now, not by the garbage collector: 5 s each)
    return written


class Interrupted(Exception):
    """A job's end mid-write, as an exception out of the writer's block (test_outputs kills one)."""


@pytest.fixture(scope="module")
def sidecar(store: Store, sa1b_dataset: str) -> str:
    """The teacher's outputs of epochs 0 and 1, written by 2 ranks straight to the bucket, their batches
    from 2 worker processes."""
    out = store.url("teacher")
    _write(out, sa1b_dataset, store.options, workers=2)
    return out


@pytest.fixture(scope="module")
def local_sidecar(sa1b_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The same outputs written to local disk (the batches from the main process)."""
    out = tmp_path_factory.mktemp("local-sidecar") / "teacher"
    _write(str(out), sa1b_dataset, None)
    return out


@pytest.fixture(scope="module")
def remote_dataset(store: Store, sa1b_dataset: str) -> str:
    """The packed SA-1B fixture uploaded to the bucket as it is."""
    url = store.url("sa1b")
    fs, base = filesystem(url, store.options)
    fs.put(f"{sa1b_dataset}/", f"{base}/", recursive=True)
    return url


def test_a_sidecar_written_to_object_storage_equals_one_written_to_local_disk(store: Store, sidecar: str,
                                                                               local_sidecar: pathlib.Path) -> None:
    objects = store.objects(sidecar)
    files = {str(p.relative_to(local_sidecar)): p.read_bytes() for p in local_sidecar.rglob("*") if p.is_file()}
    assert sorted(objects) == sorted(files)
    assert objects == files
    for epoch in EPOCHS:  # (several chunks a rank: each committed after the one before)
        for rank in range(WORLD):
            assert f"epoch-{epoch:06d}/r{rank:05d}-000001.tar" in objects


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("source", ["local", "range", "cache"])
def test_each_sample_gets_the_teachers_output_of_that_very_sample(store: Store, sidecar: str, sa1b_dataset: str,
                                                                   remote_dataset: str, tmp_path: pathlib.Path,
                                                                   source: str, workers: int) -> None:
    """The dataset on local disk, or its copy in the bucket read by range or through the shard cache
    (which then holds the sidecar's chunks too)."""
    settings: dict[str, Any] = dict(storage_options=store.options, num_workers=workers)
    if source == "cache":
        settings.update(cache_dir=str(tmp_path / "cache"), cache_limit=1 << 30)
    loader = make_stream_loader(sa1b_dataset if source == "local" else remote_dataset, "train", batch_size=2,
                                drop_last=False, seed=5, attach={"teacher": sidecar, "caption": sidecar}, **settings,
                                **AUGMENTED)
    for epoch in EPOCHS:
        loader.set_epoch(epoch)
        keys = []
        for batch in loader:
            assert batch["teacher"].dtype == torch.float16
            assert torch.equal(batch["teacher"], teacher(batch["images"]))  # bit for bit
            assert batch["caption"] == [f"of {k}" for k in batch["keys"]]
            keys += batch["keys"]
        assert sorted(keys) == sorted(split_keys(sa1b_dataset))
    loader.close()
    if source == "cache":
        manifest = store.objects(sidecar)["outputs.json"]
        chunks = {sha for epoch in json.loads(manifest)["epochs"].values() for _, _, sha in epoch["chunks"]}
        assert chunks <= {p.stem for p in (tmp_path / "cache").glob("*.tar")}


# case: (ranks, batch size, batches written when interrupted (0: not), the commits then left, the batches they
# hold (None: all)). A sample's record is 2 KiB (two tar members) and a chunk closes at the first batch past
# 3000 bytes: a chunk holds 2 batches of 1, or 1 of 2.
CASES = {
    "mid-chunk": (1, 1, 5, ["r00000-000000", "r00000-000001"], 4),  # (the 5th batch's chunk was in progress)
    # (rank 0's 3 batches, then rank 1's first chunk, whose commit is then removed: an interruption between the two)
    "a-chunk-without-its-commit": (2, 2, 4, ["r00000-000000", "r00000-000001", "r00000-000002"], 3),
    # (every rank's share committed; its indexes and outputs.json then removed: an interruption while finishing)
    "before-the-manifest": (2, 2, 0, ["r00000-000000", "r00000-000001", "r00000-000002", "r00001-000000",
                                      "r00001-000001"], None),
}


@pytest.mark.parametrize("case", CASES)
def test_an_interrupted_write_started_again_equals_an_uninterrupted_one(store: Store, sa1b_dataset: str,
                                                                        case: str) -> None:
    world, batch_size, stop, commits, done = CASES[case]
    write = dict(epochs=(1,), world=world, batch_size=batch_size, chunk_bytes=3000)
    whole, again = store.url(f"whole-{case}"), store.url(f"again-{case}")
    batches = _write(whole, sa1b_dataset, store.options, **write)
    fs, base = filesystem(again, store.options)
    if stop:
        with pytest.raises(Interrupted):
            _write(again, sa1b_dataset, store.options, **write, stop=stop)
    else:
        assert _write(again, sa1b_dataset, store.options, **write) == batches
        fs.rm([f"{base}/outputs.json", *fs.find(f"{base}/epoch-000001/index")])
    if case == "a-chunk-without-its-commit":
        fs.rm(f"{base}/epoch-000001/r00001-000000.json")
    with pytest.raises(DatasetError, match="no outputs.json"):  # (unfinished: not attached)
        make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, storage_options=store.options,
                           attach={"teacher": again}, **AUGMENTED)
    left = store.objects(again)
    assert sorted(n for n in left if n.endswith(".json")) == [f"epoch-000001/{c}.json" for c in commits]
    if case == "a-chunk-without-its-commit":
        assert "epoch-000001/r00001-000000.tar" in left
    rest = 0 if done is None else batches - done
    assert _write(again, sa1b_dataset, store.options, **write) == rest  # (only what is missing)
    objects = store.objects(whole)
    assert store.objects(again) == objects
    assert len([n for n in objects if n.endswith(".tar")]) > 2


@pytest.mark.parametrize("source", ["range", "cache"])
def test_a_linked_sidecar_in_the_bucket_attaches_each_samples_row(store: Store, sa1b_dataset: str, remote_dataset: str,
                                                                  tmp_path: pathlib.Path, source: str) -> None:
    """Vectors of an embeddings dataset in the bucket, linked there (`shard-pack link`), read by range
    or through the shard cache beside the dataset's copy in the bucket."""
    keys = split_keys(sa1b_dataset)
    ids = np.array([int(k.removeprefix("sa_")) for k in keys])
    emb, fs = store.url(f"emb-{source}"), filesystem(store.url(""), store.options)[0]
    fs.put(f"{pack_vectors(tmp_path, ids[::-1])}/", f"{filesystem(emb, store.options)[1]}/", recursive=True)
    out = store.url(f"link-{source}")
    link(emb, remote_dataset, "train", out, id_field="image_id", field="teacher", storage_options=store.options,
         progress=False)
    settings: dict[str, Any] = dict(cache_dir=str(tmp_path / "cache"), cache_limit=1 << 30) if source == "cache" else {}
    loader = make_stream_loader(remote_dataset, "train", batch_size=2, drop_last=False, num_workers=2,
                                storage_options=store.options, attach={"teacher": out}, allowed_roots=[emb],
                                **settings, **AUGMENTED)
    found = {}
    for batch in loader:
        found.update(zip(batch["keys"], batch["teacher"].numpy()))
    loader.close()
    assert sorted(found) == sorted(keys)
    for key, row in found.items():
        assert np.array_equal(row, vector(np.array([int(key.removeprefix("sa_"))]))[0])
