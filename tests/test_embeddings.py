"""The embeddings kind: packing checks and exact dtypes, blocks, loading (exactly once, shuffle,
curriculum, resume), batch checks, verify, the CLI. Arrays are built here with numpy and torch."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import sys
import tarfile

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipeline import SampleError, ShardError, make_stream_loader, validate_first_batch
from pipeline.kinds.embeddings import Embeddings, EmbeddingsOptions, Field
from pipeline.errors import InputError, RowError
from pipeline.format import (
    COLUMN_ALIGN, COLUMN_DTYPES, Manifest, pack_columns, pack_record, storage_dtype, unpack_columns, unpack_record,
)
from shard_tools.cli import main
from shard_tools.embeddings import EmbeddingsSource, pack_embeddings
from shard_tools.pack import PackOptions, pack
from conftest import indexed, split_units

N, D, K, CLUSTERS, SOURCES = 300, 8, 3, 16, 50
SPLITS = {"train": 210, "val": 45, "test": 40}  # 5 rows in no split
BLOCK = 16
FIELDS = ("question_emb", "steering", "negative_embs", "cluster_id", "source_row", "relevance", "centroid_distance",
          "steering_variant")


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (truncation), as torch stores them."""
    return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_source(folder: pathlib.Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A folder as users have it: .npy arrays, a bfloat16 tensor in a .safetensors file, split
    index files (shuffled), a referenced table, and schema.json. Returns the arrays (bf16 as bits)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {
        "question_emb": rng.standard_normal((N, D)).astype(np.float16),
        "steering": bf16_bits(rng.standard_normal((N, D))),
        "negative_embs": rng.standard_normal((N, K, D)).astype(np.float16),
        "cluster_id": rng.integers(0, CLUSTERS, N).astype(np.int32),
        "source_row": rng.integers(0, SOURCES, N).astype(np.int64),
        "relevance": rng.random(N).astype(np.float32),
        "centroid_distance": (rng.random(N) * 2).astype(np.float32),
        "steering_variant": rng.integers(0, 4, N).astype(np.int8),
    }
    for name, array in arrays.items():
        if name != "steering":
            np.save(folder / f"{name}.npy", array)
    steering = torch.from_numpy(arrays["steering"].view(np.int16)).view(torch.bfloat16)
    safetensors.torch.save_file({"steering": steering, "other": torch.zeros(2)}, str(folder / "emb.safetensors"))
    np.save(folder / "sources.npy", rng.standard_normal((SOURCES, 4)).astype(np.float32))
    perm, start = rng.permutation(N), 0
    for name, count in SPLITS.items():
        np.save(folder / f"{name}_idx.npy", perm[start : start + count])
        start += count
    schema = {
        "fields": {
            "question_emb": {"file": "question_emb.npy"},
            "steering": {"file": "emb.safetensors", "tensor": "steering"},
            "negative_embs": {"file": "negative_embs.npy"},
            "cluster_id": {"file": "cluster_id.npy", "index_into": CLUSTERS},
            "source_row": {"file": "source_row.npy", "index_into": "sources.npy"},
            "relevance": {"file": "relevance.npy", "range": [0, 1]},
            "centroid_distance": {"file": "centroid_distance.npy", "range": [0, 2]},
            "steering_variant": {"file": "steering_variant.npy", "range": [0, 3]},
        },
        "splits": {name: f"{name}_idx.npy" for name in SPLITS},
    }
    (folder / "schema.json").write_text(json.dumps(schema, indent=1))
    return arrays


def _pack(src, out, workers=1, **kw):
    options = PackOptions(splits=None, shard_samples=4, workers=workers)
    return pack_embeddings(str(src), str(out), rows_per_block=BLOCK, options=options, progress=False, **kw)


def _files(folder) -> dict[str, bytes]:
    root = pathlib.Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _split_rows(src, split) -> np.ndarray:
    return np.load(pathlib.Path(src) / f"{split}_idx.npy")


def _bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _loader(root, split="train", **kw):
    return make_stream_loader(root, split, **{"batch_size": 8, "num_workers": 0, "seed": 3, **kw})


def _epoch(loader, epoch=0):
    loader.set_epoch(epoch)
    return list(loader)


def _rows(batches) -> list[int]:
    return [r for b in batches for r in b["row"].tolist()]


@pytest.fixture(scope="session")
def emb_src(tmp_path_factory) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("emb-src")
    return folder, write_source(folder)


@pytest.fixture(scope="session")
def emb_dataset(emb_src, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("emb-shards") / "out"
    _pack(emb_src[0], out)
    return str(out)


# -- packing -------------------------------------------------------------------------------------

def test_manifest_blocks_and_splits(emb_src, emb_dataset):
    manifest = Manifest.from_json((pathlib.Path(emb_dataset) / "manifest.json").read_bytes(), "m")
    assert manifest.kind == "embeddings" and set(manifest.splits) == set(SPLITS)
    kind_options = manifest.options["kind_options"]
    assert kind_options["rows"] == N and kind_options["rows_per_block"] == BLOCK and kind_options["unassigned_rows"] == 5
    fields = {f["name"]: f for f in kind_options["fields"]}
    assert list(fields) == list(FIELDS)
    assert fields["steering"]["dtype"] == "bfloat16" and fields["negative_embs"]["shape"] == [K, D]
    assert fields["cluster_id"]["bound"] == CLUSTERS and fields["source_row"]["bound"] == SOURCES
    assert fields["relevance"]["range"] == [0, 1] and len(fields["relevance"]["sha256"]) == 64
    for split, count in SPLITS.items():
        units = [u for _, u in split_units(emb_dataset, split)]
        assert sum(units) == count and all(u == BLOCK for u in units[:-1]) and 1 <= units[-1] <= BLOCK
        assert all(shard.samples <= 4 for shard in manifest.splits[split])


def test_every_field_round_trips_exactly(emb_src, emb_dataset):
    """Every row of every split comes back bit for bit in its own dtype (bfloat16 included)."""
    src, arrays = emb_src
    dtypes = {"question_emb": torch.float16, "steering": torch.bfloat16, "negative_embs": torch.float16,
              "cluster_id": torch.int32, "source_row": torch.int64, "relevance": torch.float32,
              "centroid_distance": torch.float32, "steering_variant": torch.int8}
    for split in SPLITS:
        batches = _epoch(_loader(emb_dataset, split, batch_size=7, shuffle=False, drop_last=False))
        rows = np.array(_rows(batches))
        assert sorted(rows) == sorted(_split_rows(src, split))
        for name in FIELDS:
            assert all(b[name].dtype == dtypes[name] for b in batches)
            got = np.concatenate([_bits(b[name]) for b in batches])
            np.testing.assert_array_equal(got, arrays[name][rows], err_msg=name)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                   "float16", "bfloat16", "float32", "float64", ">f4", ">i8"])
def test_dtype_round_trips(tmp_path, dtype):
    """Extremes, -0.0, subnormals and big-endian input keep their exact values and (little-endian) dtype."""
    src = tmp_path / "src"
    src.mkdir()
    rows = 40
    if dtype == "bool":
        values = np.arange(rows * 3).reshape(rows, 3) % 3 == 0
    elif dtype == "bfloat16":
        values = bf16_bits(np.linspace(-3e38, 3e38, rows * 3)).reshape(rows, 3)
        values[0] = [0x8000, 0x0001, 0x7F7F]  # -0.0, the smallest subnormal, the largest finite
    elif np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        native = np.dtype(dtype).newbyteorder("=")
        values = np.random.default_rng(0).integers(info.min, info.max, (rows, 3), dtype=native, endpoint=True).astype(dtype)
        values[0] = [info.min, info.max, 0]
    else:
        info = np.finfo(dtype)
        values = (np.linspace(-1, 1, rows * 3) * float(info.max)).astype(dtype).reshape(rows, 3)
        values[0] = [-0.0, info.smallest_subnormal, info.max]
    if dtype == "bfloat16":
        tensor = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
        safetensors.torch.save_file({"x": tensor}, str(src / "x.safetensors"))
        file = "x.safetensors"
    else:
        np.save(src / "x.npy", values)
        file = "x.npy"
    (src / "schema.json").write_text(json.dumps({"fields": {"x": {"file": file}}}))
    _pack(src, tmp_path / "out")
    batches = _epoch(_loader(str(tmp_path / "out"), batch_size=6, shuffle=False, drop_last=False))
    x = torch.cat([b["x"] for b in batches])
    expected = {"bfloat16": torch.bfloat16, ">f4": torch.float32, ">i8": torch.int64}.get(dtype)
    assert x.dtype == (expected or getattr(torch, dtype))
    assert np.array_equal(_bits(x), values.astype(np.dtype(dtype).newbyteorder("=")) if dtype != "bfloat16" else values)
    if np.dtype(dtype if dtype != "bfloat16" else "u2").kind == "f":
        assert np.array_equal(np.signbit(_bits(x)), np.signbit(values))  # -0.0 stays -0.0


def test_safetensors_files_of_the_reference_library(tmp_path):
    """Several tensors in one file, picked by name; F16/BF16/I64 as safetensors writes them."""
    src = tmp_path / "src"
    src.mkdir()
    tensors = {"a": torch.randn(20, 4).to(torch.bfloat16), "b": torch.randn(20, 2, 3).half(), "c": torch.arange(20)}
    safetensors.torch.save_file(tensors, str(src / "t.safetensors"), metadata={"note": "made by safetensors"})
    schema = {"fields": {name: {"file": "t.safetensors", "tensor": name} for name in tensors}}
    (src / "schema.json").write_text(json.dumps(schema))
    _pack(src, tmp_path / "out")
    (batch,) = _epoch(_loader(str(tmp_path / "out"), batch_size=20, shuffle=False))
    for name, tensor in tensors.items():
        assert batch[name].dtype == tensor.dtype and torch.equal(batch[name], tensor)


def test_repeat_pack_is_byte_identical_whatever_workers(emb_src, emb_dataset, tmp_path):
    _pack(emb_src[0], tmp_path / "w2", workers=2)
    assert _files(tmp_path / "w2") == _files(emb_dataset)
    _pack(emb_src[0], tmp_path / "w1", workers=1)
    assert _files(tmp_path / "w1") == _files(emb_dataset)


def test_blocks_are_typed_columns_that_stock_tar_readers_see(emb_dataset):
    shard, index = indexed(emb_dataset, "val")[0]
    with tarfile.open(pathlib.Path(emb_dataset) / shard.name) as archive:
        names = archive.getnames()
        table, data = (archive.extractfile(n).read() for n in names[:2])
    assert names[:2] == [f"{index.key(0)}.msgpack", f"{index.key(0)}.bin"]
    columns = unpack_columns(table, data)
    assert list(columns) == ["row", *FIELDS] and columns["steering"][0] == "bfloat16"
    assert len(columns["row"][1]) == index.units[0] and list(columns["row"][1]) == sorted(columns["row"][1])


# -- bad input: named errors, nothing written -------------------------------------------------------

def test_a_truncated_safetensors_file_is_named_with_its_tensor(tmp_path):
    def change(src, arrays, schema):
        data = (src / "emb.safetensors").read_bytes()
        (src / "emb.safetensors").write_bytes(data[:-10])
    message = str(_refused(tmp_path, change).value)
    assert message.startswith("emb.safetensors: not a safetensors file (reading tensor 'steering')")


def test_safetensors_without_its_extra_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed: importing it fails
    message = str(_refused(tmp_path, lambda src, arrays, schema: None).value)
    assert "emb.safetensors" in message and "embeddings extra" in message and "safetensors>=0.4" in message


def _refused(tmp_path, change, error=InputError) -> pytest.ExceptionInfo:
    """Build a fresh source, apply `change(folder, arrays, schema)`, and check packing refuses it
    before writing anything."""
    src = tmp_path / "src"
    arrays = write_source(src)
    schema = json.loads((src / "schema.json").read_text())
    change(src, arrays, schema)
    (src / "schema.json").write_text(json.dumps(schema))
    out = tmp_path / "out"
    with pytest.raises(error) as info:
        _pack(src, out)
    assert not out.exists(), "nothing is written"
    return info


def _set(name, row, value, index=()):
    def change(src, arrays, schema):
        array = arrays[name].copy()
        array[(row, *index)] = value
        np.save(src / f"{name}.npy", array)
    return change


@pytest.mark.parametrize(("name", "row", "index", "value", "shown", "what"), [
    ("question_emb", 17, (5,), np.nan, "nan at [5]", "NaN or infinite"),
    ("negative_embs", 250, (2, 7), -np.inf, "-inf at [2, 7]", "NaN or infinite"),
    ("relevance", 3, (), 1.5, "1.5", "outside the declared range [0, 1]"),
    ("centroid_distance", 299, (), -0.25, "-0.25", "outside the declared range [0, 2]"),
    ("steering_variant", 0, (), 4, "4", "outside the declared range [0, 3]"),
    ("cluster_id", 123, (), CLUSTERS, str(CLUSTERS), f"a reference outside [0, {CLUSTERS}) (the referenced table's rows)"),
    ("cluster_id", 5, (), -1, "-1", f"a reference outside [0, {CLUSTERS}) (the referenced table's rows)"),
    ("source_row", 42, (), SOURCES, str(SOURCES), f"a reference outside [0, {SOURCES}) (the referenced table's rows)"),
])
def test_bad_values_are_named_by_file_field_row_and_value(tmp_path, name, row, index, value, shown, what):
    error = _refused(tmp_path, _set(name, row, value, index), RowError).value
    assert (error.field, error.row, error.value) == (name, row, shown)
    assert str(error) == f"{name}.npy: field {name!r}, row {row}: value {shown}: {what}"


def test_nan_in_a_bfloat16_safetensors_field(tmp_path):
    def change(src, arrays, schema):
        bits = arrays["steering"].copy()
        bits[9, 2] = 0x7FC0  # bfloat16 NaN
        tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        safetensors.torch.save_file({"steering": tensor}, str(src / "emb.safetensors"))
    error = _refused(tmp_path, change, RowError).value
    assert (error.url, error.field, error.row, error.value) == ("emb.safetensors", "steering", 9, "nan at [2]")


def test_several_problems_are_listed_together(tmp_path):
    def change(src, arrays, schema):
        _set("relevance", 7, 2.0)(src, arrays, schema)
        _set("question_emb", 8, np.inf, (0,))(src, arrays, schema)
    message = str(_refused(tmp_path, change).value)
    assert "2 problems; nothing was written" in message
    assert "field 'relevance', row 7: value 2.0" in message and "field 'question_emb', row 8: value inf at [0]" in message


def test_lengths_must_agree(tmp_path):
    message = str(_refused(tmp_path, lambda src, a, s: np.save(src / "relevance.npy", a["relevance"][:-1])).value)
    assert "disagree on their number of rows" in message
    assert "relevance.npy (relevance): 299" in message and "question_emb.npy (question_emb): 300" in message


@pytest.mark.parametrize(("split", "values", "row", "value", "what"), [
    ("val", lambda v: np.append(v, N), SPLITS["val"], str(N), f"not a row index in [0, {N})"),
    ("val", lambda v: np.append(v, v[3]), SPLITS["val"], None, "listed twice"),
    ("test", lambda v: np.append(v, -1), SPLITS["test"], "-1", "not a row index"),
])
def test_split_indices_must_be_rows_each_once(tmp_path, split, values, row, value, what):
    def change(src, arrays, schema):
        np.save(src / f"{split}_idx.npy", values(np.load(src / f"{split}_idx.npy")))
    error = _refused(tmp_path, change, RowError).value
    assert error.field == f"splits.{split}" and error.row == row and what in error.message
    assert value is None or error.value == value


def test_splits_must_not_overlap(tmp_path):
    def change(src, arrays, schema):
        train = np.load(src / "train_idx.npy")
        np.save(src / "test_idx.npy", np.append(np.load(src / "test_idx.npy"), train[0]))
    error = _refused(tmp_path, change, RowError).value
    assert error.field == "splits.test" and "in an earlier split too" in error.message


@pytest.mark.parametrize(("change", "expected"), [
    (lambda s: s.update(rows_per_block=4), "unknown key(s) ['rows_per_block']"),
    (lambda s: s["fields"]["relevance"].update(min=0), "field 'relevance': unknown key(s) ['min']"),
    (lambda s: s["splits"].update(val={"file": "val_idx.npy", "rows": 3}), "split 'val': unknown key(s) ['rows']"),
    (lambda s: s["fields"]["relevance"].update(range=[1, 0]), "range must be [low, high]"),
    (lambda s: s["fields"]["relevance"].update(index_into=3), "has \"index_into\" but dtype float32"),
    (lambda s: s["fields"].update(row={"file": "relevance.npy"}), "not 'row'"),
    (lambda s: s["fields"]["steering"].pop("tensor"), "holds tensors ['other', 'steering']: name one"),
])
def test_schema_mistakes_are_named(tmp_path, change, expected):
    message = str(_refused(tmp_path, lambda src, arrays, schema: change(schema)).value)
    assert expected in message


def test_missing_files_are_named(tmp_path):
    def change(src, arrays, schema):
        os.unlink(src / "centroid_distance.npy")
    assert str(_refused(tmp_path, change).value) == "centroid_distance.npy: no such file"
    with pytest.raises(InputError, match="no schema file"):
        EmbeddingsSource.load(str(tmp_path / "src"), schema=str(tmp_path / "nope.json"))


def test_an_input_on_object_storage_is_refused_saying_why(tmp_path, caplog):
    """The arrays are memory-mapped, so they are packed from a local folder: a URL is named as such
    (it once read as a relative path: "/cwd/s3:/bucket/emb: not a folder")."""
    for argv in (["embeddings", "s3://bucket/emb", str(tmp_path / "out")],
                 ["embeddings", str(tmp_path), str(tmp_path / "out"), "--schema", "s3://bucket/emb/schema.json"]):
        caplog.clear()
        assert main(["-q", *argv]) == 2
        assert "s3://bucket/emb" in caplog.text and "packed from a local folder (their arrays are memory-mapped): " \
            "copy them from object storage first; OUT may be a URL" in caplog.text
    assert not (tmp_path / "out").exists()


def test_a_file_changed_after_its_check_is_not_packed(tmp_path):
    src = tmp_path / "src"
    arrays = write_source(src)
    source = EmbeddingsSource.load(str(src), rows_per_block=BLOCK)
    np.save(src / "relevance.npy", arrays["relevance"][::-1].copy())
    with pytest.raises(InputError, match="relevance.npy: changed since it was checked"):
        pack(source, [str(src)], str(tmp_path / "out"), PackOptions(splits=None), progress=False)


class _Payload:
    """Unpickling this creates a file: proof that a loader ran pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("how", ["torch.save .pt", "pickle named .npy", "object .npy"])
def test_pickle_based_files_are_refused_unopened(tmp_path, how):
    marker = tmp_path / "pwned"

    def change(src, arrays, schema):
        if how == "torch.save .pt":
            torch.save({"x": torch.zeros(N), "payload": _Payload(str(marker))}, src / "relevance.pt")
            schema["fields"]["relevance"]["file"] = "relevance.pt"
        elif how == "pickle named .npy":
            (src / "relevance.npy").write_bytes(pickle.dumps(_Payload(str(marker))))
        else:
            np.save(src / "relevance.npy", np.array([_Payload(str(marker))] * N, dtype=object), allow_pickle=True)
    message = str(_refused(tmp_path, change).value)
    assert "pickle" in message and ".safetensors" in message and ".npy" in message
    assert not marker.exists(), "no pickle was run"


def test_cli_refuses_bad_input_with_exit_code_1(tmp_path, capsys, caplog):
    src = tmp_path / "src"
    arrays = write_source(src)
    relevance = arrays["relevance"].copy()
    relevance[11] = np.nan
    np.save(src / "relevance.npy", relevance)
    assert main(["-q", "embeddings", str(src), str(tmp_path / "out")]) == 1
    assert "field 'relevance', row 11: value nan: NaN or infinite" in caplog.text
    assert not (tmp_path / "out").exists()
    assert main(["-q", "embeddings", str(src), str(tmp_path / "out"), "--rows-per-block", "0"]) == 2


# -- loading -------------------------------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
def test_every_row_once_across_ranks_and_workers(emb_src, emb_dataset, drop_last):
    train = set(_split_rows(emb_src[0], "train").tolist())
    batch = 8
    for world_size in (1, 2, 3):
        for workers in (0, 1, 2):
            seen, lengths = [], set()
            for rank in range(world_size):
                loader = _loader(emb_dataset, num_workers=workers, rank=rank, world_size=world_size, drop_last=drop_last,
                                 batch_size=batch)
                batches = _epoch(loader, 2)
                assert len(batches) == len(loader)
                lengths.add(len(batches))
                if drop_last:
                    assert all(len(b["row"]) == batch for b in batches)
                seen += _rows(batches)
            assert len(lengths) == 1, "every rank yields the same number of batches"
            assert len(seen) == len(set(seen)) and set(seen) <= train
            dropped = len(train) - len(seen)
            assert dropped == 0 if not drop_last else 0 <= dropped < world_size * batch


def test_shuffle_is_a_row_permutation_deterministic_per_seed_and_epoch(emb_src, emb_dataset):
    train = sorted(_split_rows(emb_src[0], "train").tolist())
    loader = _loader(emb_dataset, drop_last=False, shuffle_window=64)
    orders = {epoch: _rows(_epoch(loader, epoch)) for epoch in (0, 1)}
    assert sorted(orders[0]) == train and sorted(orders[1]) == train
    assert orders[0] != orders[1], "each epoch has its own order"
    assert _rows(_epoch(_loader(emb_dataset, drop_last=False, shuffle_window=64), 1)) == orders[1]
    assert _rows(_epoch(_loader(emb_dataset, drop_last=False, shuffle_window=64, seed=4), 1)) != orders[1]
    # Rows, not blocks, are shuffled: a batch draws on several blocks, in no block's order.
    block_of = {row: i // BLOCK for i, row in enumerate(train)}
    first = _epoch(loader, 0)[0]["row"].tolist()
    assert len({block_of[r] for r in first}) > 1 and first != sorted(first)


def test_a_broken_block_is_skipped_whole_and_counted(emb_dataset, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(emb_dataset, root)
    shard, index = indexed(str(root))[0]
    with open(root / shard.name, "r+b") as f:  # the second block's first tar header: its checksum
        f.seek(index.span(1)[0] + 148)
        f.write(b"0000000\0")
    in_order = _rows(_epoch(_loader(emb_dataset, shuffle=False, drop_last=False)))
    lost = set(in_order[index.units[0] : index.units[0] + index.units[1]])
    clean = _rows(_epoch(_loader(emb_dataset, batch_size=32)))  # (no batch of only broken rows: that is an error)
    assert len(lost) == BLOCK and lost & set(clean)
    for workers in (0, 2):
        loader = _loader(str(root), num_workers=workers, on_error="skip", batch_size=32)
        rows = _rows(_epoch(loader))
        assert sorted(rows) == sorted(set(clean) - lost) and loader.skipped == len(lost & set(clean))
    with pytest.raises(ShardError, match=f"{index.key(1)}.*checksum mismatch"):
        list(_loader(str(root)))


def test_same_batches_for_any_workers_and_worker_lifetime(emb_dataset):
    def run(workers, persistent):
        loader = _loader(emb_dataset, num_workers=workers, persistent_workers=persistent)
        return [[b["row"].tolist() for b in _epoch(loader, epoch)] for epoch in (0, 1)]
    reference = run(0, None)
    for workers, persistent in [(1, True), (2, True), (2, False)]:
        assert run(workers, persistent) == reference


def test_resume_equals_uninterrupted(emb_dataset):
    full = _epoch(_loader(emb_dataset), 1)
    for workers in (0, 2):
        first = _loader(emb_dataset, num_workers=workers)
        first.set_epoch(1)
        taken = []
        for batch in first:
            taken.append(batch)
            if len(taken) == 5:
                break
        resumed = _loader(emb_dataset, num_workers=workers)
        resumed.load_state_dict(first.state_dict())
        rest = _epoch(resumed, 1)
        assert [b["row"].tolist() for b in taken + rest] == [b["row"].tolist() for b in full]
        for got, expected in zip(rest, full[5:]):
            assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_curriculum_schedule_reaches_persistent_workers(emb_src, emb_dataset):
    arrays = emb_src[1]
    loader = _loader(emb_dataset, num_workers=2, persistent_workers=True,
                     take={"negative_embs": lambda epoch: min(epoch + 1, K)})
    for epoch in (0, 1, 2, 3, 0):
        batches = _epoch(loader, epoch)
        count = min(epoch + 1, K)
        for batch in batches:
            assert batch["negative_embs"].shape == (8, count, D)
            assert np.array_equal(batch["negative_embs"].numpy(), arrays["negative_embs"][batch["row"].numpy(), :count])
            assert not loader.kind.check(batch, epoch)


def test_mixing_datasets_of_the_same_fields(emb_src, emb_dataset, tmp_path):
    other = tmp_path / "other"
    write_source(other, seed=1)
    _pack(other, tmp_path / "out")
    loader = make_stream_loader([emb_dataset, str(tmp_path / "out")], "train", batch_size=10, num_workers=0,
                                weights=[0.5, 0.5], epoch_size=200)
    batches = _epoch(loader, 0)
    assert sum(len(b["row"]) for b in batches) == 200 and not loader.kind.check(batches[0], 0)
    schema = json.loads((other / "schema.json").read_text())
    del schema["fields"]["steering"]
    (other / "schema.json").write_text(json.dumps(schema))
    _pack(other, tmp_path / "fewer")
    with pytest.raises(ValueError, match="cannot mix datasets with fields"):
        make_stream_loader([emb_dataset, str(tmp_path / "fewer")], "train", batch_size=10, num_workers=0)


def test_fields_select_what_batches_hold_and_device_moves_them(emb_src, emb_dataset):
    batch = next(iter(_loader(emb_dataset, fields=("question_emb", "cluster_id"), take={}, device="cpu", num_workers=1)))
    assert set(batch) == {"row", "question_emb", "cluster_id"}
    rows = batch["row"].numpy()
    assert np.array_equal(batch["question_emb"].numpy(), emb_src[1]["question_emb"][rows])
    assert batch["question_emb"].is_contiguous() and batch["cluster_id"].shape == (8,)


@pytest.mark.parametrize(("options", "message"), [
    ({"fields": ("nope",)}, "unknown: ['nope']"),
    ({"take": {"relevance": 1}}, "has no axis to take from"),
    ({"take": {"negative_embs": K + 1}}, f"take['negative_embs'] must be an int in [0, {K}]"),
    ({"take": {"negative_embs": 1}, "fields": ("question_emb",)}, "is not a field batches hold"),
    ({"max_masks": 3}, "embeddings datasets do not take 'max_masks'"),
])
def test_bad_options_are_refused(emb_dataset, options, message):
    with pytest.raises(ValueError) as info:
        _loader(emb_dataset, **options)
    assert message in str(info.value)


def test_a_schedule_giving_a_bad_count_is_named(emb_dataset):
    loader = _loader(emb_dataset, take={"negative_embs": lambda epoch: epoch * 10})
    assert len(_epoch(loader, 0)) > 0
    with pytest.raises(ValueError, match=r"take\['negative_embs'\] .* got 10 for epoch 1"):
        _epoch(loader, 1)


# -- batch checks --------------------------------------------------------------------------------

def test_validate_first_batch_and_what_check_catches(emb_dataset):
    loader = _loader(emb_dataset, batch_size=16)
    batch = validate_first_batch(loader)
    options = loader.kind.options
    assert Embeddings(options).check(batch, 0) == []

    def problems(name, change):
        bad = {k: v.clone() for k, v in batch.items()}
        bad[name] = change(bad[name])
        return Embeddings(options).check(bad, 0)

    def put(index, value):
        def change(tensor):
            tensor[index] = value
            return tensor
        return change

    row = int(batch["row"][2])
    assert problems("relevance", put(2, 1.25)) == [f"relevance: row {row}: value 1.25: outside the declared range [0, 1]"]
    assert problems("question_emb", put((2, 4), float("nan"))) == [f"question_emb: row {row}: value nan at [4]: NaN or infinite"]
    assert problems("steering", put((2, 1), float("inf"))) == [f"steering: row {row}: value inf at [1]: NaN or infinite"]
    assert problems("cluster_id", put(2, CLUSTERS))[0].startswith(f"cluster_id: row {row}: value {CLUSTERS}: a reference")
    assert problems("steering_variant", put(2, -1)) == [f"steering_variant: row {row}: value -1: outside the declared range [0, 3]"]
    assert problems("relevance", lambda t: t.double()) == ["relevance: dtype torch.float64, expected torch.float32"]
    assert problems("negative_embs", lambda t: t[:, :2]) == [f"negative_embs: shape (16, 2, {D}), expected (16, {K}, {D})"]
    assert problems("row", put(1, int(batch["row"][0]))) == ["row: a row appears twice in the batch"]
    del batch["steering"]
    assert Embeddings(options).check(batch, 0)[0].startswith("keys ")


# -- hostile blocks and verify ---------------------------------------------------------------------

def _options() -> EmbeddingsOptions:
    return EmbeddingsOptions((Field("e", "float16", (2,)), Field("c", "int32", (), bound=5),
                              Field("r", "float32", (), range=(0.0, 1.0))), rows=10)


def _block(rows=(1, 2), e=None, c=(0, 4), r=(0.5, 1.0), e_dtype="float16", c_dtype="int32"):
    e = np.zeros((len(rows), 2), np.float16) if e is None else e
    columns = [("row", "int64", np.array(rows, np.int64)), ("e", e_dtype, e),
               ("c", c_dtype, np.array(c, c_dtype)), ("r", "float32", np.array(r, np.float32))]
    table, data = pack_columns(columns)
    return {"msgpack": table, "bin": data}


@pytest.mark.parametrize(("members", "field", "message"), [
    ({"msgpack": _block()["msgpack"]}, None, "members ['msgpack'], expected ['bin', 'msgpack']"),
    ({**_block(), "bin": _block()["bin"] + b"\0"}, "msgpack", "invalid column table"),
    ({**_block(), "msgpack": pack_record({"rows": 2})}, "msgpack", "not a column table"),
    (_block(c_dtype="int64"), "c", "int64[] per row, the manifest says int32[]"),
    (_block(e=np.zeros((2, 3), np.float16)), "e", "float16[3] per row, the manifest says float16[2]"),
    (_block(rows=(1, 10)), "row", "row indices outside [0, 10)"),
    (_block(c=(0, 5)), "c", "row 2: value 5: a reference outside [0, 5)"),
    (_block(r=(0.5, -1.0)), "r", "row 2: value -1.0: outside the declared range [0.0, 1.0]"),
])
def test_hostile_blocks_are_refused_with_the_field_named(members, field, message):
    with pytest.raises(SampleError) as info:
        Embeddings(_options()).open(members, url="s.tar", key="train-000000")
    assert info.value.field == field and message in info.value.message


def test_a_block_of_other_rows_than_the_manifest_says_is_refused_when_opened():
    assert Embeddings(_options()).open(_block(), url="s", key="k", units=2).rows == 2
    with pytest.raises(SampleError, match="2 rows, the manifest says 3") as info:
        Embeddings(_options()).open(_block(), url="s", key="k", units=3)  # (batches gather rows unchecked after this)
    assert info.value.field == "row"


def test_nan_in_a_block_is_caught_when_values_are_checked():
    members = _block(e=np.array([[0, np.nan], [1, 2]], np.float16))
    assert Embeddings(_options()).open(members, url="s", key="k").rows == 2  # training reads skip the float scan
    options = EmbeddingsOptions(_options().schema, rows=10, check_values=True)
    with pytest.raises(SampleError, match=r"row 1: value nan at \[1\]: NaN or infinite"):
        Embeddings(options).open(members, url="s", key="k")


@given(st.lists(st.tuples(st.sampled_from(COLUMN_DTYPES), st.lists(st.integers(0, 3), max_size=2)), min_size=1,
                max_size=5), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_columns_round_trip_bit_for_bit(specs, rows, seed):
    rng = np.random.default_rng(seed)
    columns = []
    for i, (dtype, shape) in enumerate(specs):
        raw = rng.integers(0, 256, rows * int(np.prod(shape, dtype=np.int64)) * storage_dtype(dtype).itemsize, np.uint8)
        columns.append((f"c{i}", dtype, raw.view(storage_dtype(dtype)).reshape(rows, *shape)))
    table, data = pack_columns(columns)
    got = unpack_columns(table, data)
    assert list(got) == [name for name, _, _ in columns]
    for name, dtype, array in columns:
        assert got[name][0] == dtype and got[name][1].dtype == array.dtype
        assert got[name][1].tobytes() == array.tobytes() and got[name][1].shape == array.shape
    assert all(column[3] % COLUMN_ALIGN == 0 for column in unpack_record(table)["columns"])


def test_column_tables_refuse_what_the_writer_never_makes():
    table, data = _block()["msgpack"], _block()["bin"]
    assert set(unpack_columns(table, data)) == {"row", "e", "c", "r"}
    obj = unpack_record(table)
    for change in (lambda o: o["columns"][1].__setitem__(3, 8),  # an offset off the layout
                   lambda o: o["columns"][1].__setitem__(1, "complex64"),
                   lambda o: o["columns"][2].__setitem__(0, "e"),  # a duplicate name
                   lambda o: o["columns"][1].__setitem__(2, [3, 2]),  # rows that disagree
                   lambda o: o["columns"][1].__setitem__(2, [2, 2 ** 62])):  # a huge claimed size
        bad = json.loads(json.dumps(obj))
        change(bad)
        with pytest.raises(ValueError):
            unpack_columns(pack_record(bad), data)


def test_verify_passes_and_catches_a_corrupted_value(emb_dataset, tmp_path, capsys):
    assert main(["-q", "verify", emb_dataset]) == 0
    assert "verify: OK" in capsys.readouterr().out
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in _files(emb_dataset).items():
        (copy / name).write_bytes(data)
    shard, index = indexed(str(copy))[1]
    path = copy / shard.name
    with tarfile.open(path) as archive:
        member = archive.getmember(f"{index.key(0)}.bin")
        table = archive.extractfile(f"{index.key(0)}.msgpack").read()
    offset = next(c[3] for c in unpack_record(table)["columns"] if c[0] == "relevance")
    data = bytearray(path.read_bytes())
    data[member.offset_data + offset : member.offset_data + offset + 4] = np.float32(7.5).tobytes()
    path.write_bytes(bytes(data))
    assert main(["-q", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"{shard.name}: SHA-256" in out
    assert f"sample {index.key(0)!r}, field 'relevance': row" in out and "value 7.5: outside the declared range" in out


def test_cli_pack_and_inspect(emb_src, emb_dataset, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["-q", "embeddings", str(emb_src[0]), str(out), "--rows-per-block", str(BLOCK), "--shard-samples", "4",
                 "--workers", "1"]) == 0
    assert "packed 20 samples, 295 rows into 6 shards" in capsys.readouterr().out
    assert _files(out) == _files(emb_dataset)
    assert main(["inspect", str(out)]) == 0
    assert "kind embeddings" in capsys.readouterr().out


def test_stock_webdataset_reads_the_blocks(emb_dataset):
    import webdataset as wds
    manifest = Manifest.from_json((pathlib.Path(emb_dataset) / "manifest.json").read_bytes(), "m")
    urls = [str(pathlib.Path(emb_dataset) / s.name) for s in manifest.splits["test"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    rows = [r for s in samples for r in unpack_columns(s["msgpack"], s["bin"])["row"][1].tolist()]
    assert len(samples) == manifest.samples("test") and len(rows) == SPLITS["test"]
