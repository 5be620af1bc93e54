"""Finishing an epoch of a sidecar (`pipeline.outputs.epochs.finish_epoch`) in groups of shards: the
indexes and manifest made with a group of a few items each are those made in one group, byte for
byte; an item written twice, or never, is named."""

from __future__ import annotations

import base64
import json
import pathlib

import numpy as np
import pytest

from pipeline import make_stream_loader
from pipeline.errors import DatasetError
from pipeline.outputs import epochs
from pipeline.storage import Retry, filesystem

from test_outputs import AUGMENTED, write


def _finish_again(sidecar: pathlib.Path, dataset: str, folder: str) -> None:
    """The epoch's indexes and manifest removed, then made again from the commits."""
    of = json.loads((sidecar / "outputs.json").read_text())["of"]
    for index in (sidecar / folder / "index").iterdir():
        index.unlink()
    (sidecar / "outputs.json").unlink()
    sources = make_stream_loader(dataset, "train", batch_size=3, drop_last=False, seed=5, **AUGMENTED).stream.sources
    fs, base = filesystem(str(sidecar), None)
    assert epochs.finish_epoch(str(sidecar), folder, of, sources, fs, base, Retry(), required=True)


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_groups_of_a_few_items_make_the_same_indexes_as_one(sa1b_dataset: str, tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "teacher"
    write(str(out), sa1b_dataset, epochs=(0,), world=2)
    whole = _files(out)
    monkeypatch.setattr(epochs, "GROUP_ITEMS", 2)  # (shards of 3 samples: a group a shard)
    _finish_again(out, sa1b_dataset, "epoch-000000")
    assert _files(out) == whole


def test_an_item_written_twice_or_never_is_named(sa1b_dataset: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "teacher"
    write(str(out), sa1b_dataset, epochs=(0,), world=1)
    commit = out / "epoch-000000" / "r00000-000000.json"
    record = json.loads(commit.read_text())
    rows = np.frombuffer(base64.b64decode(record["records"]), "<i8").reshape(-1, 4).copy()
    rows[1, 1] = rows[0, 1]  # (the second record claims the first's item)
    record["records"] = base64.b64encode(rows.tobytes()).decode()
    commit.write_text(json.dumps(record))
    with pytest.raises(DatasetError, match=r"item \d+ of source 0 was written (2|0) times"):
        _finish_again(out, sa1b_dataset, "epoch-000000")
