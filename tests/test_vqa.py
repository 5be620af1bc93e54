"""The vqa kind: packing each layout, grouping, detection, leakage and bad input; reading per
question and per image, exactly once in every world (the TRL form: tests/test_trainers.py)."""

from __future__ import annotations

import collections
import io
import json
import os
import pathlib
import shutil
import tarfile

import msgpack
import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import SampleError, make_stream_loader, validate_first_batch
from pipeline.errors import ConfigError
from pipeline.format import Manifest, pack_record
from pipeline.images import smart_resize
from pipeline.rle import fit
from pipeline.kinds.vqa import Vqa, VqaOptions
from shard_tools.cli import main
from shard_tools.pack import PackError, PackOptions, TooManySkipped
from shard_tools.samples.vqa import write_images, write_vqa
from shard_tools.vqa import VqaSource, detect_layout, image_key, pack_vqa
from conftest import index_of, indexed, split_units

LAYOUTS = ("vqa-rad", "slake", "llava")
SPLITS = {"train": 8, "val": 3, "test": 3}


def _source(images, files, **kw) -> VqaSource:
    return VqaSource(str(images), tuple((name, str(file)) for name, file in files.items()), **kw)


def _files(folder) -> dict[str, bytes]:
    root = pathlib.Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _manifest(root) -> Manifest:
    return Manifest.from_json((pathlib.Path(root) / "manifest.json").read_bytes(), str(root))


def _samples(root) -> dict[tuple[str, str], tuple[str, bytes, dict]]:
    """Every packed sample: (split, key) -> (image extension, image bytes, record)."""
    out = {}
    for split, shards in _manifest(root).splits.items():
        for shard in shards:
            with tarfile.open(pathlib.Path(root) / shard.name) as archive:
                members = [(m.name, archive.extractfile(m).read()) for m in archive]
            for (image_name, data), (record_name, record) in zip(members[::2], members[1::2]):
                key, ext = image_name.split(".")
                assert record_name == f"{key}.msgpack"
                out[(split, key)] = (ext, data, msgpack.unpackb(record))
    return out


def _expected(layout: str, records: list[dict]) -> dict[str, list[tuple[str, str, dict]]]:
    """image path -> [(question, answer, original record)] in input order, as the layout defines them."""
    out: dict[str, list] = collections.defaultdict(list)
    for r in records:
        if layout == "llava":
            turns = r["conversations"]
            for h, g in zip(turns[::2], turns[1::2]):
                out[r["image"]].append((h["value"].replace("<image>", "").strip(), g["value"], r))
        else:
            image = r["image_name" if layout == "vqa-rad" else "img_name"]
            out[image].append((r["question"], str(r["answer"]), r))
    return out


@pytest.fixture(scope="session")
def collections_(tmp_path_factory) -> dict[str, tuple[pathlib.Path, dict[str, pathlib.Path]]]:
    """Each layout's collection: an image folder and train/val/test files (1 to 5 questions per image)."""
    root = tmp_path_factory.mktemp("vqa-src")
    return {layout: (root / layout / "images", write_vqa(root / layout, layout, SPLITS, per_image=(1, 5), seed=i))
            for i, layout in enumerate(LAYOUTS)}


@pytest.fixture(scope="session")
def packed(collections_, tmp_path_factory) -> dict[str, str]:
    out = {}
    for layout, (images, files) in collections_.items():
        dest = tmp_path_factory.mktemp(f"vqa-{layout}")
        pack_vqa(_source(images, files), str(dest), PackOptions(shard_samples=3), progress=False)
        out[layout] = str(dest)
    return out


# -- packing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_packs_every_question_and_field_once_per_image(layout, collections_, packed):
    images, files = collections_[layout]
    samples = _samples(packed[layout])
    manifest = _manifest(packed[layout])
    assert manifest.kind == "vqa" and set(manifest.splits) == set(SPLITS) and not manifest.skipped
    units = {(split, k): u for split in manifest.splits for k, u in split_units(str(packed[layout]), split)}
    for split, file in files.items():
        expected = _expected(layout, json.loads(file.read_text()))
        got = {record["image"]["path"]: (key, ext, data, record) for (s, key), (ext, data, record) in samples.items()
               if s == split}
        assert set(got) == set(expected) and len(got) == SPLITS[split], "each image stored once in its split"
        for path, asked in expected.items():
            key, ext, data, record = got[path]
            assert key == image_key(path) and record["split"] == split
            assert data == (images / path).read_bytes(), "original bytes kept"
            assert ext == {"JPEG": "jpg", "PNG": "png"}[record["image"]["format"]]
            with Image.open(images / path) as original:
                assert (record["image"]["height"], record["image"]["width"]) == (original.height, original.width)
                assert record["image"]["mode"] == original.mode and record["stored_size"] == [original.height, original.width]
            assert [(q["question"], q["answer"], q["fields"]) for q in record["questions"]] == asked
            assert all(q["layout"] == layout and q["source"] == str(file) for q in record["questions"])
            assert units[(split, key)] == len(asked)
    assert max(units.values()) >= 3, "the fixture has images with many questions"


def test_one_image_with_many_questions_is_stored_once_per_split(tmp_path):
    images = tmp_path / "images"
    write_images(images, ["a.jpg", "b.png"], seed=3)
    many = [{"qid": i, "image_name": "a.jpg", "question": f"Question {i}?", "answer": f"answer {i}"} for i in range(40)]
    (tmp_path / "train.json").write_text(json.dumps(many + [{"qid": 99, "image_name": "b.png", "question": "Q?",
                                                             "answer": "yes"}]))
    pack_vqa(_source(images, {"train": tmp_path / "train.json"}), str(tmp_path / "out"), progress=False)
    samples = _samples(tmp_path / "out")
    assert len(samples) == 2
    record = samples[("train", image_key("a.jpg"))][2]
    assert [q["record"] for q in record["questions"]] == list(range(40))
    (shard, index), = indexed(str(tmp_path / "out"))
    assert sorted(index.units.tolist()) == [1, 40] and shard.units == 41
    assert (tmp_path / "out" / shard.name).read_bytes().count((images / "a.jpg").read_bytes()) == 1


def test_layout_detection_override_and_unknown_layout(collections_, tmp_path, caplog):
    for layout, (_, files) in collections_.items():
        assert detect_layout(json.loads(files["train"].read_text()), "f") == layout
    images, files = collections_["vqa-rad"]
    records = json.loads(files["train"].read_text())
    # Both image fields: ambiguous until --layout says which one holds the image.
    both = [dict(r, img_name=r["image_name"]) for r in records]
    (tmp_path / "both.json").write_text(json.dumps(both))
    with pytest.raises(PackError, match=r"both.json: ambiguous between vqa-rad and slake"):
        pack_vqa(_source(images, {"train": tmp_path / "both.json"}), str(tmp_path / "a"), progress=False)
    assert main(["-q", "vqa", "--images", str(images), "--split", f"train={tmp_path / 'both.json'}", "--layout", "slake",
                 str(tmp_path / "b")]) == 0
    assert {q["layout"] for *_, r in _samples(tmp_path / "b").values() for q in r["questions"]} == {"slake"}
    # An unknown layout stops the pack (exit 2), naming the file, the fields seen and the flags to use.
    other = [{"picture": r["image_name"], "prompt_text": r["question"], "reply": r["answer"], "n": i}
             for i, r in enumerate(records)]
    (tmp_path / "other.json").write_text(json.dumps(other))
    argv = ["-q", "vqa", "--images", str(images), "--split", f"train={tmp_path / 'other.json'}", str(tmp_path / "c")]
    caplog.clear()
    assert main(argv) == 2
    assert "other.json: unknown layout: record 0 has fields ['n', 'picture', 'prompt_text', 'reply']" in caplog.text
    assert "--image-key" in caplog.text and not (tmp_path / "c" / "manifest.json").exists()
    # ... and the explicit mapping packs it, keeping every original field.
    assert main(argv + ["--image-key", "picture", "--question-key", "prompt_text", "--answer-key", "reply"]) == 0
    got = [q for *_, r in _samples(tmp_path / "c").values() for q in r["questions"]]
    assert sorted(q["fields"]["n"] for q in got) == list(range(len(records)))
    assert all(q["layout"] == "mapped" and q["question"] == q["fields"]["prompt_text"] for q in got)
    # A forced layout no record fits is an error too.
    with pytest.raises(PackError, match=r"train.json: none of its \d+ records fits layout llava .*no image"):
        pack_vqa(_source(images, files, layout="llava"), str(tmp_path / "d"), progress=False)
    with pytest.raises(ValueError, match="give all three"):
        VqaSource(str(images), (("train", "x.json"),), image_key="picture")
    with pytest.raises(ValueError, match="layout must be one of"):
        VqaSource(str(images), (("train", "x.json"),), layout="vqa2")


def _leaky(tmp_path) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """train/val/test where val and test ask about train's image shared.jpg."""
    images = tmp_path / "images"
    write_images(images, ["shared.jpg", "t1.jpg", "v1.png", "s1.jpg"], seed=4)

    def rec(qid, image, q="What organ is shown?"):
        return {"qid": qid, "image_name": image, "question": q, "answer": "retina"}

    files = {"train": [rec(1, "shared.jpg"), rec(2, "t1.jpg"), rec(3, "shared.jpg", "Is it normal?")],
             "val": [rec(10, "v1.png"), rec(11, "shared.jpg"), rec(12, "shared.jpg", "Any lesion?")],
             "test": [rec(20, "s1.jpg"), rec(21, "shared.jpg")]}
    for name, records in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(records))
    return images, {name: tmp_path / f"{name}.json" for name in files}


def test_leakage_is_reported_and_skipped_in_the_later_splits(tmp_path):
    images, files = _leaky(tmp_path)
    summary = pack_vqa(_source(images, files), str(tmp_path / "out"), PackOptions(max_skipped=2), progress=False)
    assert summary.skipped == 2
    reasons = [s["reason"] for s in _manifest(tmp_path / "out").skipped]
    val, test = (next(r for r in reasons if f"in {name!r} (" in r) for name in ("val", "test"))
    for reason, name in ((val, "val"), (test, "test")):
        assert reason.startswith("shared.jpg: leakage: the image is in split 'train'")
        assert f"{files['train']} record 0 (qid 1), {files['train']} record 2 (qid 3)" in reason
        assert f"and in split {name!r}; kept in 'train'" in reason and str(files[name]) in reason
    assert "skipped its 2 question(s) in 'val'" in val and "(qid 11)" in val and "(qid 12)" in val
    where = {split: {r["image"]["path"] for (s, _), (_, _, r) in _samples(tmp_path / "out").items() if s == split}
             for split in files}
    assert where == {"train": {"shared.jpg", "t1.jpg"}, "val": {"v1.png"}, "test": {"s1.jpg"}}
    # Past --max-skipped the pack fails; the order of --split says which split keeps the image.
    with pytest.raises(TooManySkipped, match="2 samples skipped"):
        pack_vqa(_source(images, files), str(tmp_path / "fail"), PackOptions(max_skipped=1), progress=False)
    first_test = {"test": files["test"], "train": files["train"], "val": files["val"]}
    pack_vqa(_source(images, first_test), str(tmp_path / "t"), PackOptions(max_skipped=2), progress=False)
    kept = {s for (s, _), (_, _, r) in _samples(tmp_path / "t").items() if r["image"]["path"] == "shared.jpg"}
    assert kept == {"test"}
    # shared_images="keep" stores it in each split, with a warning instead of skips.
    summary = pack_vqa(_source(images, files, shared_images="keep"), str(tmp_path / "k"), progress=False)
    assert summary.skipped == 0
    kept = {s for (s, _), (_, _, r) in _samples(tmp_path / "k").items() if r["image"]["path"] == "shared.jpg"}
    assert kept == {"train", "val", "test"}


@pytest.fixture()
def bad_collection(tmp_path) -> tuple[pathlib.Path, dict[str, pathlib.Path], dict[str, tuple[str, ...]]]:
    """A VQA-RAD train file and a LLaVA test file with every kind of bad input; expected skip reasons."""
    images = tmp_path / "images"
    good = [f"g{i}.jpg" for i in range(4)]
    write_images(images, good + ["gone.jpg", "cut.jpg", "text.jpg", "empty.png", "cut.png", "l1.jpg", "l2.png"], seed=6)
    (images / "gone.jpg").unlink()
    cut = (images / "cut.jpg").read_bytes()
    (images / "cut.jpg").write_bytes(cut[: len(cut) * 2 // 3])
    (images / "text.jpg").write_text("this is not an image\n")
    (images / "empty.png").write_bytes(b"")
    (images / "cut.png").write_bytes((images / "cut.png").read_bytes()[:-60])

    def rec(qid, image, q="What organ is shown?", a="retina"):
        return {"qid": qid, "image_name": image, "question": q, "answer": a, "answer_type": "OPEN"}

    train = [rec(0, "g0.jpg"), rec(1, "g1.jpg"), rec(2, "g1.jpg", q=""), rec(3, "g2.jpg", a=None),
             {k: v for k, v in rec(4, "g2.jpg").items() if k != "answer"}, rec(5, "gone.jpg"), rec(6, "gone.jpg"),
             rec(7, "cut.jpg"), rec(8, "text.jpg"), rec(9, "empty.png"), rec(10, "cut.png"), rec(11, "../up.jpg"),
             {k: v for k, v in rec(12, "g3.jpg").items() if k != "image_name"}, rec(13, "g3.jpg", a=7), "not a record"]
    conv = [{"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "retina"}]
    test = [{"id": "ok", "image": "l1.jpg", "conversations": conv},
            {"id": "half", "image": "l2.png", "conversations": conv + [{"from": "human", "value": "And?"}]},
            {"id": "bare", "image": "l2.png", "conversations": [{"from": "human", "value": "<image>"},
                                                                 {"from": "gpt", "value": "x"}]}]
    files = {"train": tmp_path / "train.json", "test": tmp_path / "test.json"}
    files["train"].write_text(json.dumps(train))
    files["test"].write_text(json.dumps(test))
    t, s = str(files["train"]), str(files["test"])
    expected = {
        "q": (f"{t} record 2 (qid 2): empty question",),
        "a-null": (f"{t} record 3 (qid 3): no answer",),
        "a-missing": (f"{t} record 4 (qid 4): no answer",),
        "gone": ("gone.jpg: image not found under", f"{t} record 5 (qid 5), {t} record 6 (qid 6)",
                 "skipped its 2 question(s) in 'train'"),
        "cut": ("cut.jpg: sample", "truncated or corrupt image", f"({t} record 7 (qid 7))"),
        "text": ("text.jpg: sample", "not a JPEG or PNG image", f"({t} record 8 (qid 8))"),
        "empty": ("empty.png: sample", "not a JPEG or PNG image", f"({t} record 9 (qid 9))"),
        "cut-png": ("cut.png: sample", "truncated or corrupt image", f"({t} record 10 (qid 10))"),
        "up": (f"{t} record 11 (qid 11): image path '../up.jpg' is not a path inside --images",),
        "no-image": (f"{t} record 12 (qid 12): no image",),
        "not-object": (f"{t} record 14: a JSON str, not an object",),
        "half": (f"{s} record 1 (id half): no answer to conversations[2]",),
        "bare": (f"{s} record 2 (id bare): no question in conversations[0] (only the <image> token)",),
    }
    return images, files, expected


def test_bad_input_is_skipped_named_counted_and_listed(bad_collection, tmp_path, capsys):
    images, files, expected = bad_collection
    summary = pack_vqa(_source(images, files), str(tmp_path / "out"), PackOptions(max_skipped=13), progress=False)
    reasons = [s["reason"] for s in _manifest(tmp_path / "out").skipped]
    assert summary.skipped == len(reasons) == len(expected) == 13
    for name, parts in expected.items():
        assert any(all(p in r for p in parts) for r in reasons), (name, reasons)
    kept = {(s, r["image"]["path"]): [q["answer"] for q in r["questions"]]
            for (s, _), (_, _, r) in _samples(tmp_path / "out").items()}
    assert kept == {("train", "g0.jpg"): ["retina"], ("train", "g1.jpg"): ["retina"], ("train", "g3.jpg"): ["7"],
                    ("test", "l1.jpg"): ["retina"]}, "the good records all land, numbers as JSON text"
    assert summary.counts == {"samples": 4, "questions": 4}
    assert main(["verify", str(tmp_path / "out")]) == 0
    argv = ["-q", "vqa", "--images", str(images), "--split", f"train={files['train']}", "--split",
            f"test={files['test']}"]
    assert main(argv + [str(tmp_path / "cli"), "--max-skipped", "12"]) == 1
    assert not (tmp_path / "cli" / "manifest.json").exists()
    with pytest.raises(TooManySkipped, match="13 samples skipped, more than --max-skipped 12"):
        pack_vqa(_source(images, files), str(tmp_path / "lib"), PackOptions(max_skipped=12), progress=False)
    capsys.readouterr()
    assert main(argv + [str(tmp_path / "cli"), "--max-skipped", "13"]) == 0, "finishes the kept shards"
    assert "packed 4 samples, 4 questions" in capsys.readouterr().out
    assert _files(tmp_path / "cli") == _files(tmp_path / "out")


def test_an_image_unreadable_when_packed_is_named_with_its_records(tmp_path):
    images = tmp_path / "images"
    write_images(images, ["a.jpg"], seed=2)
    (tmp_path / "t.json").write_text(json.dumps([{"qid": 5, "image_name": "a.jpg", "question": "Q?", "answer": "A"}]))
    source = _source(images, {"train": tmp_path / "t.json"})
    (ref,), _ = source.index(source.files)
    (images / "a.jpg").unlink()  # gone between listing and packing (or unreadable: permissions, I/O)
    with pytest.raises(SampleError, match=rf"a.jpg: sample .*cannot read the image.*\({tmp_path / 't.json'} record 0 \(qid 5\)\)"):
        source.encode(ref)


def test_repeat_pack_is_byte_identical_whatever_workers(collections_, packed, tmp_path):
    images, files = collections_["slake"]
    pack_vqa(_source(images, files), str(tmp_path / "w2"), PackOptions(shard_samples=3, workers=2), progress=False)
    assert _files(tmp_path / "w2") == _files(packed["slake"])
    argv = ["-q", "vqa", "--images", str(images), *[f"--split={n}={f}" for n, f in files.items()], "--shard-samples",
            "3", "--workers", "1", str(tmp_path / "cli")]
    assert main(argv) == 0
    assert _files(tmp_path / "cli") == _files(packed["slake"])


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_pack_resumes_without_redoing_shards(collections_, packed, tmp_path, workers):
    images, files = collections_["vqa-rad"]
    out, finished = tmp_path / "out", []

    def interrupt(name: str) -> None:
        finished.append(name)
        if len(finished) == 2:
            raise KeyboardInterrupt

    options = PackOptions(shard_samples=3, workers=workers)
    with pytest.raises(KeyboardInterrupt):
        pack_vqa(_source(images, files), str(out), options, progress=False, on_shard=interrupt)
    assert not (out / "manifest.json").exists()
    done = {name: os.stat(out / name) for name in finished}
    summary = pack_vqa(_source(images, files), str(out), options, progress=False)
    assert summary.reused >= 2
    for name, before in done.items():
        assert os.stat(out / name).st_mtime_ns == before.st_mtime_ns, f"{name} was rewritten"
    assert _files(out) == _files(packed["vqa-rad"])


def test_an_edited_annotation_file_is_another_input(collections_, tmp_path):
    images, files = collections_["vqa-rad"]
    copies = {name: tmp_path / file.name for name, file in files.items()}
    for name, file in files.items():
        shutil.copy(file, copies[name])

    def stop(name: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack_vqa(_source(images, copies), str(tmp_path / "out"), PackOptions(shard_samples=3), progress=False,
                 on_shard=stop)
    edited = json.loads(copies["val"].read_text())
    edited[0]["answer"] = "changed"  # same size and records: only its SHA-256 tells
    copies["val"].write_text(json.dumps(edited))
    with pytest.raises(PackError, match="unfinished pack of other inputs"):
        pack_vqa(_source(images, copies), str(tmp_path / "out"), PackOptions(shard_samples=3), progress=False)


def test_image_max_side_reencodes_in_the_same_format(collections_, tmp_path):
    images, files = collections_["llava"]
    pack_vqa(_source(images, files, image_max_side=40), str(tmp_path / "small"), progress=False)
    for _, data, record in _samples(tmp_path / "small").values():
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == record["image"]["format"] and max(image.size) == 40
            assert [image.height, image.width] == record["stored_size"]
            assert record["stored_size"] == list(fit(record["image"]["height"], record["image"]["width"], 40))
    assert main(["verify", str(tmp_path / "small")]) == 0


def test_cli_inspect_and_verify_find_a_damaged_image(packed, tmp_path, capsys):
    out = tmp_path / "copy"
    shutil.copytree(packed["vqa-rad"], out)
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "kind vqa" in text and "split train: 8 samples" in text and "split test: 3 samples" in text
    assert main(["verify", str(out)]) == 0
    shard = _manifest(out).splits["train"][0]
    data = bytearray((out / shard.name).read_bytes())
    data[512 + 200 : 512 + 400] = b"\0" * 200  # inside the first image
    (out / shard.name).write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert "SHA-256" in capsys.readouterr().out


# -- reading ---------------------------------------------------------------------------------------


def _units(root, split="train") -> set[tuple[str, int]]:
    return {(k, i) for k, u in split_units(str(root), split) for i in range(u)}


@pytest.mark.parametrize("per", ["question", "image"])
def test_every_question_or_image_once_across_ranks_and_workers(packed, per):
    root = packed["llava"]
    everything = _units(root)
    for world_size in (1, 2):
        for workers in (0, 2):
            seen, lengths = [], set()
            for rank in range(world_size):
                loader = make_stream_loader(root, "train", batch_size=3, num_workers=workers, rank=rank,
                                            world_size=world_size, drop_last=False, per=per, image_size=32, seed=1)
                loader.set_epoch(2)
                batches = list(loader)
                lengths.add(len(batches))
                for b in batches:
                    assert Vqa(VqaOptions(per=per, image_size=32)).check(b, 2) == []
                    if per == "question":
                        seen += list(zip(b["keys"], b["question_index"].tolist()))
                    else:
                        seen += b["keys"]
                        assert b["question_counts"].tolist() == [len(q) for q in b["questions"]]
            assert len(lengths) == 1, "every rank yields the same number of batches"
            want = sorted(everything) if per == "question" else sorted({k for k, _ in everything})
            assert sorted(seen) == want, (world_size, workers)


@pytest.mark.parametrize("image_size", [40, None])
def test_batches_hold_the_right_images_questions_and_fields(collections_, packed, image_size):
    images, files = collections_["vqa-rad"]
    expected = _expected("vqa-rad", json.loads(files["val"].read_text()))
    loader = make_stream_loader(packed["vqa-rad"], "val", batch_size=4, num_workers=2, drop_last=False,
                                image_size=image_size)
    seen = 0
    for batch in loader:
        assert Vqa(VqaOptions(image_size=image_size)).check(batch, 0) == []
        if image_size is None:
            assert list(batch["images"].shape[2:]) == batch["image_sizes"].max(0).values.tolist(), "padded to the largest"
        for i, path in enumerate(batch["paths"]):
            question, answer, record = expected[path][int(batch["question_index"][i])]
            assert (batch["questions"][i], batch["answers"][i], batch["fields"][i]) == (question, answer, record)
            with Image.open(images / path) as original:
                mode, size = original.mode, (original.height, original.width)
                wide = Image.fromarray((np.asarray(original).astype(np.int64) >> 8).astype(np.uint8)) \
                    if mode == "I;16" else original
                rgb = wide.convert("RGB")
            h, w = fit(*size, image_size) if image_size else size
            assert batch["image_sizes"][i].tolist() == [h, w] and batch["original_sizes"][i].tolist() == list(size)
            got = batch["images"][i, :, :h, :w].permute(1, 2, 0).numpy().astype(int)
            want = np.asarray(rgb.resize((w, h), Image.Resampling.BILINEAR) if image_size else rgb).astype(int)
            if image_size is None:
                assert (got == want).all(), "as stored: exact"
            assert np.abs(got - want).mean() < 8, path
            if mode in ("L", "I;16"):
                assert (got[..., 0] == got[..., 1]).all() and (got[..., 1] == got[..., 2]).all(), "gray replicated"
            assert not batch["images"][i, :, h:].any() and not batch["images"][i, :, :, w:].any(), "zero padding"
            seen += 1
    assert seen == sum(len(v) for v in expected.values())


BUDGET = dict(image_size=None, pixel_factor=16, min_pixels=80 * 80, max_pixels=96 * 96)  # some images up, some down


def test_a_pixel_budget_gives_each_image_smart_resize_of_its_original_size(collections_, packed):
    images, files = collections_["vqa-rad"]
    expected = _expected("vqa-rad", json.loads(files["val"].read_text()))
    options = VqaOptions(**BUDGET)
    loader = make_stream_loader(packed["vqa-rad"], "val", batch_size=4, num_workers=2, drop_last=False, **BUDGET)
    seen, grew, shrank = 0, False, False
    for batch in loader:
        assert Vqa(options).check(batch, 0) == []
        assert list(batch["images"].shape[2:]) == batch["image_sizes"].max(0).values.tolist(), "padded to the largest"
        for i, path in enumerate(batch["paths"]):
            with Image.open(images / path) as original:
                size, mode = (original.height, original.width), original.mode
                wide = Image.fromarray((np.asarray(original).astype(np.int64) >> 8).astype(np.uint8)) \
                    if mode == "I;16" else original
                rgb = wide.convert("RGB")
            h, w = smart_resize(*size, 16, 80 * 80, 96 * 96)
            assert batch["original_sizes"][i].tolist() == list(size) and batch["image_sizes"][i].tolist() == [h, w]
            assert h % 16 == 0 and w % 16 == 0 and h * w <= 96 * 96
            grew, shrank = grew or h * w > size[0] * size[1], shrank or h * w < size[0] * size[1]
            got = batch["images"][i, :, :h, :w].permute(1, 2, 0).numpy().astype(int)
            want = np.asarray(rgb.resize((w, h), Image.Resampling.BILINEAR)).astype(int)
            assert np.abs(got - want).mean() < 8, path
            assert not batch["images"][i, :, h:].any() and not batch["images"][i, :, :, w:].any(), "zero padding"
            seen += 1
        for sample in Vqa(options).unbatch(batch):
            assert list(sample["images"].shape[1:]) == sample["image_sizes"].tolist(), "unpadded"
        wrong = dict(batch, image_sizes=batch["image_sizes"] + 16, images=torch.nn.functional.pad(batch["images"],
                                                                                                  (0, 16, 0, 16)))
        assert any("pixel budget" in p for p in Vqa(options).check(wrong, 0))
    assert seen == sum(len(v) for v in expected.values()) and grew and shrank


def test_a_pixel_budget_is_checked_and_refuses_an_image_too_elongated(packed):
    given = {"pixel_factor": 28}
    assert VqaOptions(image_size=None, **given) == VqaOptions(image_size=None, min_pixels=56 * 56,
                                                              max_pixels=28 * 28 * 1280), "Qwen2-VL's defaults"
    assert VqaOptions(image_size=None).budget is None and VqaOptions(image_size=None, **given).budget == (28, 3136,
                                                                                                          1003520)
    cases = [
        ({"min_pixels": 3136}, r"min_pixels=3136: the pixel budget sizes each image on its own and needs "
                               r"image_size=None, got image_size=448"),
        ({"image_size": None, "pixel_factor": 0}, r"pixel_factor must be a positive int \(None: Qwen2-VL's 28\), "
                                                  r"got 0"),
        ({"image_size": None, "min_pixels": 2.5}, r"min_pixels must be a positive int .* got 2.5"),
        ({"image_size": None, "max_pixels": True}, r"max_pixels must be a positive int .* got True"),
        ({"image_size": None, "max_pixels": 700}, r"max_pixels must be in \[pixel_factor\*\*2, max_image_pixels\] = "
                                                  r"\[784, \d+\], got 700"),
        ({"image_size": None, "max_pixels": 1 << 40}, r"max_pixels must be in .*, got 1099511627776"),
        ({"image_size": None, "min_pixels": 5000, "max_pixels": 4000}, r"min_pixels must be at most max_pixels "
                                                                       r"\(4000\), got 5000"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            VqaOptions(**options)
    with pytest.raises(ConfigError, match="needs image_size=None"):
        make_stream_loader(packed["vqa-rad"], "train", batch_size=2, num_workers=0, max_pixels=4096)
    (ext, data, record) = next(iter(_samples(packed["vqa-rad"]).values()))
    kind = Vqa(VqaOptions(image_size=None, pixel_factor=28))
    long = {**record, "image": {**record["image"], "height": 2, "width": 403}}  # as the original: 1:201.5
    sample = kind.open({ext: data, "msgpack": pack_record(long)}, url="shard.tar", key="k")
    with pytest.raises(SampleError, match=r"shard.tar: sample 'k', field 'image': 2x403 \(h x w\) has no pixel "
                                          r"budget: aspect ratio 201.5 is over 200") as caught:
        kind.decode(sample, seed=0, epoch=0, url="shard.tar", key="k")
    assert (caught.value.url, caught.value.key, caught.value.field) == ("shard.tar", "k", "image")


def test_preview_takes_the_pixel_budget_as_flags(packed, tmp_path, caplog):
    argv = ["preview", packed["slake"], "--split", "train", "-n", "2", "--out", str(tmp_path / "p.png")]
    assert main([*argv, "--image-size", "none", "--max-pixels", "4096", "--pixel-factor", "14"]) == 0
    assert main([*argv, "--max-pixels", "4096"]) == 2
    assert "max_pixels=4096: the pixel budget sizes each image on its own and needs image_size=None" in caplog.text


def test_a_state_of_another_pixel_budget_is_refused(packed):
    def loader(**budget):
        return make_stream_loader(packed["vqa-rad"], "train", batch_size=2, num_workers=0, image_size=None, **budget)

    first = loader(max_pixels=64 * 64)
    next(iter(first))
    state = first.state_dict()
    loader(max_pixels=64 * 64, pixel_factor=28).load_state_dict(state)  # the same budget in full
    with pytest.raises(ValueError, match=r"other options of the kind \(max_pixels: 4096 there, 9216 here\)"):
        loader(max_pixels=96 * 96).load_state_dict(state)
    with pytest.raises(ValueError, match=r"other options of the kind \(.*pixel_factor: 28 there, None here"):
        loader().load_state_dict(state)


def test_per_image_batches_carry_each_images_questions(collections_, packed):
    _, files = collections_["slake"]
    expected = _expected("slake", json.loads(files["train"].read_text()))
    loader = make_stream_loader(packed["slake"], "train", batch_size=3, num_workers=0, per="image", image_size=24,
                                drop_last=False)
    batch = validate_first_batch(loader)
    assert batch["images"].shape[1:] == (3, 24, 24)
    for i, path in enumerate(batch["paths"]):
        assert list(zip(batch["questions"][i], batch["answers"][i], batch["fields"][i])) == expected[path]


def test_check_batch_finds_problems(packed):
    loader = make_stream_loader(packed["vqa-rad"], "train", batch_size=2, num_workers=0, image_size=32)
    batch = next(iter(loader))
    options = VqaOptions(image_size=32)
    assert Vqa(options).check(batch, 0) == []
    assert any("dtype" in p for p in Vqa(options).check(dict(batch, images=batch["images"].float()), 0))
    padded = dict(batch, images=batch["images"].clone(), image_sizes=batch["image_sizes"].clone())
    padded["image_sizes"][0] = torch.tensor([1, 1])
    assert any("long side" in p for p in Vqa(options).check(padded, 0))
    assert any("list of 2" in p for p in Vqa(options).check(dict(batch, questions=batch["questions"][:1]), 0))
    assert "keys" in Vqa(options).check({"images": batch["images"]}, 0)[0]


def test_records_are_checked_strictly_when_read(packed):
    (ext, data, record) = next(iter(_samples(packed["vqa-rad"]).values()))
    options = VqaOptions()

    def opened(members):
        return Vqa(options).open(members, url="shard.tar", key="k")

    assert opened({ext: data, "msgpack": pack_record(record)}).questions == record["questions"]
    cases = {
        "unknown field": ({ext: data, "msgpack": pack_record({**record, "extra": 1})}, "fields"),
        "no questions": ({ext: data, "msgpack": pack_record({**record, "questions": []})}, "questions"),
        "bad question": ({ext: data, "msgpack": pack_record({**record, "questions": [{"question": "q"}]})}, "questions"),
        "wrong member": ({"gif": data, "msgpack": pack_record(record)}, "members"),
        "format/ext": ({"png" if ext == "jpg" else "jpg": data, "msgpack": pack_record(record)}, "format"),
        "not msgpack": ({ext: data, "msgpack": b"\xc1"}, "cannot unpack"),
    }
    for members, text in cases.values():
        with pytest.raises(SampleError, match=text):
            opened(members)
    for value in ("bad", 0, True):
        with pytest.raises(ValueError):
            VqaOptions(per=value) if isinstance(value, str) else VqaOptions(image_size=value)
    with pytest.raises(ValueError, match="vqa datasets do not take 'mask_size'"):
        make_stream_loader(packed["vqa-rad"], "train", batch_size=2, num_workers=0, mask_size=3)


def test_stock_webdataset_reads_the_shards(packed):
    import webdataset

    manifest = _manifest(packed["slake"])
    for shards in manifest.splits.values():
        urls = [str(pathlib.Path(packed["slake"]) / s.name) for s in shards]
        samples = list(webdataset.WebDataset(urls, shardshuffle=False))
        assert [s["__key__"] for s in samples] == [k for s in shards for k in index_of(packed["slake"], s).key_list()]
        for sample in samples:
            record = msgpack.unpackb(sample["msgpack"])
            ext = {"JPEG": "jpg", "PNG": "png"}[record["image"]["format"]]
            assert {k for k in sample if not k.startswith("__")} == {ext, "msgpack"}
            assert Image.open(io.BytesIO(sample[ext])).size == (record["image"]["width"], record["image"]["height"])


def test_json_lines_with_a_bad_line(collections_, tmp_path):
    images, files = collections_["llava"]
    records = json.loads(files["train"].read_text())
    lines = [json.dumps(r) for r in records]
    lines.insert(2, '{"id": "broken", "image": ')
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n\n")
    summary = pack_vqa(_source(images, {"train": tmp_path / "train.jsonl"}), str(tmp_path / "out"), progress=False)
    skipped, = _manifest(tmp_path / "out").skipped
    assert skipped["reason"].startswith(f"{tmp_path / 'train.jsonl'} record 2: line 3 is not valid JSON")
    assert summary.samples == len(records) and summary.counts["questions"] == len(_units(tmp_path / "out"))
