"""Outputs written from a loop (`pipeline.OutputWriter`) and attached at load time (`attach=`):
every sample's attached output is the teacher's output of that very sample, bit for bit, whatever
the batch size, world size and workers of either pass; a killed write resumed equals an
uninterrupted one byte for byte; sidecars of other samples, epochs or unfinished are refused."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

from pipeline import OutputWriter, make_stream_dataset, make_stream_loader
from pipeline.errors import ConfigError, DatasetError, ShardstreamError

from conftest import split_keys, split_units

SA1B = dict(image_size=64, mask_size=16, max_masks=4)
AUGMENTED = dict(SA1B, hflip=0.5, scale_jitter=(0.5, 1.5))


def teacher(images: torch.Tensor) -> torch.Tensor:
    """A deterministic CPU teacher: each image's 8x8 block means, per channel (float16), row by row."""
    b, c, h, w = images.shape
    return (images.float().reshape(b, c, h // 8, 8, w // 8, 8).mean((3, 5)) / 255).to(torch.float16)


def write(out: str, dataset: str, epochs: tuple[int, ...] = (0, 1), world: int = 1, batch_size: int = 3,
          **options: Any) -> None:
    """The teacher's outputs of every sample of `dataset`'s train split, one rank after the other."""
    for epoch in epochs:
        for rank in range(world):
            loader = make_stream_loader(dataset, "train", batch_size=batch_size, drop_last=False, seed=5,
                                        rank=rank, world_size=world, **{**AUGMENTED, **options})
            loader.set_epoch(epoch)
            with OutputWriter(out, loader, inputs=("images",), chunk_bytes=2000) as writer:
                for batch in loader:
                    writer.write(batch["keys"], {"teacher": teacher(batch["images"]),
                                                 "caption": [f"of {k}" for k in batch["keys"]]})


@pytest.fixture(scope="module")
def sidecar(sa1b_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The teacher's outputs of epochs 0 and 1 under hflip and scale jitter, written by 2 ranks."""
    out = str(tmp_path_factory.mktemp("sidecar") / "teacher")
    write(out, sa1b_dataset, world=2)
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_each_sample_gets_the_teachers_output_of_that_very_sample(sa1b_dataset: str, sidecar: str, workers: int,
                                                                   world: int) -> None:
    seen: dict[int, list[str]] = {0: [], 1: []}
    for rank in range(world):
        loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, drop_last=False, seed=5, rank=rank,
                                    world_size=world, num_workers=workers, attach={"teacher": sidecar,
                                                                                   "caption": sidecar}, **AUGMENTED)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for batch in loader:
                assert batch["teacher"].dtype == torch.float16
                assert torch.equal(batch["teacher"], teacher(batch["images"]))  # bit for bit
                assert batch["caption"] == [f"of {k}" for k in batch["keys"]]
                seen[epoch] += batch["keys"]
        loader.close()
    for keys in seen.values():
        assert sorted(keys) == sorted(split_keys(sa1b_dataset))


def test_the_augmentation_differs_between_epochs_and_so_do_the_outputs(sa1b_dataset: str, sidecar: str) -> None:
    """(Else the test above would pass with one epoch's outputs served for both.)"""
    outputs = {}
    for epoch in (0, 1):
        loader = make_stream_loader(sa1b_dataset, "train", batch_size=9, drop_last=False, seed=5, shuffle=False,
                                    attach={"teacher": sidecar}, **AUGMENTED)
        loader.set_epoch(epoch)
        outputs[epoch] = next(iter(loader))["teacher"]
    assert not torch.equal(outputs[0], outputs[1])


def test_a_stream_dataset_flattened_attaches_each_row(sa1b_dataset: str, sidecar: str) -> None:
    dataset = make_stream_dataset(sa1b_dataset, "train", batch_size=4, drop_last=False, seed=5, flatten=True,
                                  attach={"teacher": sidecar}, **AUGMENTED)
    dataset.set_epoch(1)
    rows = list(dataset)
    assert sorted(row["keys"] for row in rows) == sorted(split_keys(sa1b_dataset))
    for row in rows:
        assert torch.equal(row["teacher"], teacher(row["images"][None])[0])


def test_images_without_augmentation_are_written_once_for_every_epoch_and_seed(sa1b_dataset: str,
                                                                               tmp_path: pathlib.Path) -> None:
    out = str(tmp_path / "once")
    write(out, sa1b_dataset, epochs=(0,), hflip=0.0, scale_jitter=None)
    manifest = json.loads(pathlib.Path(out, "outputs.json").read_text())
    assert list(manifest["epochs"]) == ["all"] and manifest["of"]["seed"] is None
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=4, drop_last=False, seed=99, max_masks=2,
                                image_size=64, mask_size=8, attach={"teacher": out})
    for epoch in (0, 3):
        loader.set_epoch(epoch)
        for batch in loader:
            assert torch.equal(batch["teacher"], teacher(batch["images"]))


def test_a_sidecar_of_other_samples_is_refused_naming_what_differs(sa1b_dataset: str, sidecar: str,
                                                                   vqa: str) -> None:
    cases = [
        (dict(split="val"), "split: 'train' there, 'val' here"),
        (dict(seed=6), "seed: 5 there, 6 here"),
        (dict(image_size=32), "image_size: 64 there, 32 here"),
        (dict(hflip=0.25), "hflip: 0.5 there, 0.25 here"),
    ]
    for change, message in cases:
        settings = {**AUGMENTED, "batch_size": 2, "seed": 5, "split": "train", **change}
        split = settings.pop("split")
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            make_stream_loader(sa1b_dataset, split, attach={"teacher": sidecar}, **settings)
    with pytest.raises(ConfigError, match="datasets"):
        make_stream_loader(vqa, "train", batch_size=2, attach={"teacher": sidecar})


def test_an_epoch_the_sidecar_lacks_is_refused_before_any_batch(sa1b_dataset: str, sidecar: str) -> None:
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, attach={"teacher": sidecar},
                                **AUGMENTED)
    with pytest.raises(ConfigError, match=r"epochs \[0, 1\], not of epoch 2"):
        loader.set_epoch(2)
    state = {**loader.state_dict(), "epoch": 7}
    with pytest.raises(ConfigError, match="not of epoch 7"):
        loader.load_state_dict(state)


def test_an_unfinished_or_unknown_field_sidecar_is_refused(sa1b_dataset: str, sidecar: str,
                                                             tmp_path: pathlib.Path) -> None:
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=3, drop_last=False, seed=5, **AUGMENTED)
    out = str(tmp_path / "half")
    with OutputWriter(out, loader, inputs=("images",), chunk_bytes=1) as writer:
        for batch in loader:
            writer.write(batch["keys"], {"teacher": teacher(batch["images"])})
            break
    with pytest.raises(DatasetError, match="no outputs.json"):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, attach={"teacher": out}, **AUGMENTED)
    with pytest.raises(ConfigError, match=r"no field 'logits'; it has \['caption', 'teacher'\]"):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, attach={"logits": sidecar}, **AUGMENTED)
    with pytest.raises(ConfigError, match="'images' is a field the sa1b batch has already"):
        make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, attach={"images": sidecar}, **AUGMENTED)


def test_a_record_of_another_sample_is_an_error_naming_its_key(sa1b_dataset: str, tmp_path: pathlib.Path) -> None:
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=9, drop_last=False, seed=5, **AUGMENTED)
    out = str(tmp_path / "shifted")
    with OutputWriter(out, loader, inputs=("images",)) as writer:
        for batch in loader:  # (each row's output under the next row's key)
            writer.write(batch["keys"][1:] + batch["keys"][:1], {"teacher": teacher(batch["images"])})
    student = make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, attach={"teacher": out}, **AUGMENTED)
    with pytest.raises(ShardstreamError, match=r"sa_\d+"):
        next(iter(student))


def test_writer_misuse_is_refused(sa1b_dataset: str, tmp_path: pathlib.Path) -> None:
    out = str(tmp_path / "misuse")
    with pytest.raises(ConfigError, match="drop_last=True leaves 1 of the epoch's 9 samples out"):
        OutputWriter(out, make_stream_loader(sa1b_dataset, "train", batch_size=2, **SA1B))
    with pytest.raises(ConfigError, match="on_error='raise'"):
        OutputWriter(out, make_stream_loader(sa1b_dataset, "train", batch_size=2, on_error="skip", **SA1B))
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, drop_last=False, **SA1B)
    with pytest.raises(ConfigError, match="inputs"):
        OutputWriter(out, loader, inputs=("pixels",))
    with OutputWriter(out, loader) as writer:
        batches = iter(loader)
        first = next(batches)
        writer.write(first["keys"], {"teacher": teacher(first["images"])})
        with pytest.raises(ConfigError, match="each batch the loader yields, once, in order"):
            writer.write(first["keys"], {"teacher": teacher(first["images"])})
        second = next(batches)
        with pytest.raises(ConfigError, match=r"outputs teacher: float32 \[3, 8, 8\]; earlier batches had "
                                              r"teacher: float16 \[3, 8, 8\]"):
            writer.write(second["keys"], {"teacher": teacher(second["images"]).float()})
        with pytest.raises(ConfigError, match="3 keys for a batch of 2"):
            writer.write(second["keys"] + ["x"], {"teacher": teacher(second["images"])})


def test_a_restart_in_another_world_size_is_refused(sa1b_dataset: str, tmp_path: pathlib.Path) -> None:
    out = str(tmp_path / "worlds")
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, drop_last=False, rank=0, world_size=2, **SA1B)
    with OutputWriter(out, loader, chunk_bytes=1) as writer:
        batch = next(iter(loader))
        writer.write(batch["keys"], {"teacher": teacher(batch["images"])})
    again = make_stream_loader(sa1b_dataset, "train", batch_size=2, drop_last=False, **SA1B)
    with pytest.raises(ConfigError, match="was being written by 2 ranks"):
        with OutputWriter(out, again):
            pass


_KILLED_WRITER = """
import os, signal, sys
import torch
from pipeline import OutputWriter, make_stream_loader
sys.path.insert(0, {tests!r})
from test_outputs import AUGMENTED, teacher
dataset, out, world, batch_size, kill_after, wait = sys.argv[1:3] + [int(a) for a in sys.argv[3:]]
written = 0
for rank in range(world):
    loader = make_stream_loader(dataset, "train", batch_size=batch_size, drop_last=False, seed=5, rank=rank,
                                world_size=world, **AUGMENTED)
    loader.set_epoch(1)
    with OutputWriter(out, loader, inputs=("images",), chunk_bytes=3000) as writer:
        for batch in loader:
            writer.write(batch["keys"], {{"teacher": teacher(batch["images"])}})
            written += 1
            if written == kill_after:
                if wait:
                    writer._chunks.wait()  # (the commits so far are written)
                os.kill(os.getpid(), signal.SIGKILL)  # (else: the last one may be half written)
print(written)
"""


def _run_writer(dataset: str, out: pathlib.Path, world: int, batch_size: int, kill_after: int = 0,
                wait: bool = True) -> int:
    """Batches the writer script wrote (it writes each rank's share in turn), or -1: killed after `kill_after`."""
    script = _KILLED_WRITER.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), dataset, str(out), str(world),
                           str(batch_size), str(kill_after), str(int(wait))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == (-9 if kill_after else 0), done.stderr
    return int(done.stdout) if done.stdout else -1


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _committed(folder: pathlib.Path, rank: int) -> int:
    commits = sorted(folder.glob(f"r{rank:05d}-*.json"))
    return json.loads(commits[-1].read_text())["batches"] if commits else 0


@pytest.mark.parametrize("world, batch_size, kill_after, wait", [(1, 1, 5, True), (2, 2, 5, False)])
def test_a_killed_write_started_again_writes_only_the_rest_and_equals_an_uninterrupted_one(
        sa1b_dataset: str, tmp_path: pathlib.Path, world: int, batch_size: int, kill_after: int, wait: bool) -> None:
    """Killed mid-chunk, after a commit (world 1: 3 batches of 1 to a chunk, killed at the 5th), or
    while a chunk is being written (world 2: rank 1's first chunk, in flight)."""
    whole = _run_writer(sa1b_dataset, tmp_path / "whole", world, batch_size)
    assert _run_writer(sa1b_dataset, tmp_path / "again", world, batch_size, kill_after, wait) == -1
    assert not (tmp_path / "again" / "outputs.json").exists()
    folder = tmp_path / "again" / "epoch-000001"
    done = [_committed(folder, rank) for rank in range(world)]
    if wait:
        assert done == [3]  # (batches 4 and 5 were in the chunk in progress)
    assert _run_writer(sa1b_dataset, tmp_path / "again", world, batch_size) == whole - sum(done)
    assert _tree(tmp_path / "again") == _tree(tmp_path / "whole")
    assert len([n for n in _tree(tmp_path / "whole") if n.endswith(".tar")]) > 2


def test_a_complete_epoch_is_not_written_again(sa1b_dataset: str, sidecar: str) -> None:
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=3, drop_last=False, seed=5, rank=1, world_size=2,
                                **AUGMENTED)
    before = _tree(pathlib.Path(sidecar))
    with OutputWriter(sidecar, loader, inputs=("images",)):
        assert list(loader) == []
    assert _tree(pathlib.Path(sidecar)) == before


def test_units_of_a_sample_each_get_their_own_output(vqa: str, tmp_path: pathlib.Path) -> None:
    """VQA per question: a sample's questions are units, each its own row and its own record."""
    out = str(tmp_path / "answers")
    loader = make_stream_loader(vqa, "train", batch_size=4, drop_last=False, image_size=32)
    with OutputWriter(out, loader) as writer:
        for batch in loader:
            writer.write(batch["keys"], {"answer": [f"{q}?{a}" for q, a in zip(batch["questions"], batch["answers"])],
                                         "mean": batch["images"].float().mean((1, 2, 3)).numpy()[:, None]})
    student = make_stream_loader(vqa, "train", batch_size=3, drop_last=False, image_size=32, num_workers=2,
                                 attach={"answer": out, "mean": out})
    rows = 0
    for batch in student:
        assert batch["answer"] == [f"{q}?{a}" for q, a in zip(batch["questions"], batch["answers"])]
        assert torch.equal(batch["mean"], batch["images"].float().mean((1, 2, 3))[:, None])
        rows += len(batch["keys"])
    assert rows == sum(units for _, units in split_units(vqa)) > 8


def test_item_index_with_a_record_outside_its_chunks_is_refused(sa1b_dataset: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "tampered"
    write(str(out), sa1b_dataset, epochs=(0,), hflip=0.0, scale_jitter=None)
    index = sorted((out / "all" / "index").iterdir())[0]
    data = bytearray(index.read_bytes())
    data[-8:] = np.int64(1 << 40).tobytes()  # (the last record's end, far past its chunk)
    index.write_bytes(bytes(data))
    manifest = json.loads((out / "outputs.json").read_text())
    for ref in manifest["epochs"]["all"]["indexes"][0]:
        if ref[0].endswith(index.name):
            ref[2] = hashlib.sha256(bytes(data)).hexdigest()
    (out / "outputs.json").write_text(json.dumps(manifest))
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=9, drop_last=False, image_size=64, mask_size=8,
                                attach={"teacher": str(out)})
    with pytest.raises(ShardstreamError, match="outside the chunks"):
        next(iter(loader))


def test_rows_of_a_kind_without_keys_get_their_own_outputs(emb: str, tmp_path: pathlib.Path) -> None:
    """Embeddings: rows grouped by block in a batch, no keys; each record is named by its plan item."""
    out = str(tmp_path / "emb")
    loader = make_stream_loader(emb, "train", batch_size=5, drop_last=False, seed=1)
    with OutputWriter(out, loader) as writer:
        for batch in loader:
            writer.write(None, {"double": (batch["x"] * 2).numpy(), "tag": [f"row {r}" for r in batch["row"].tolist()]})
    for workers, batch_size in ((0, 4), (2, 3)):
        student = make_stream_loader(emb, "train", batch_size=batch_size, drop_last=False, seed=1,
                                     num_workers=workers, attach={"double": out, "tag": out})
        rows = []
        for batch in student:
            assert torch.equal(batch["double"], batch["x"] * 2)
            assert batch["tag"] == [f"row {r}" for r in batch["row"].tolist()]
            rows += batch["row"].tolist()
        assert sorted(rows) == list(range(23))


def test_a_trainer_dataset_in_a_dataloader_of_workers_attaches_each_row(sa1b_dataset: str, sidecar: str) -> None:
    from torch.utils.data import DataLoader

    from pipeline import trainer_dataset

    dataset = trainer_dataset(sa1b_dataset, "train", batch_size=2, drop_last=False, seed=5,
                              attach={"teacher": sidecar, "caption": sidecar}, **AUGMENTED)
    dataset.set_epoch(0)
    keys = []
    for batch in DataLoader(dataset, batch_size=2, num_workers=2,
                            collate_fn=lambda rows: {k: [r[k] for r in rows] for k in rows[0]}):
        for image, output, caption, key in zip(batch["images"], batch["teacher"], batch["caption"], batch["keys"]):
            assert torch.equal(output, teacher(image[None])[0]) and caption == f"of {key}"
            keys.append(key)
    assert sorted(keys) == sorted(split_keys(sa1b_dataset))


def test_a_resumption_in_another_world_size_attaches_the_rest_exactly(sa1b_dataset: str, sidecar: str) -> None:
    """Stopped after 2 batches on 1 rank, resumed on 2: the rest of the epoch, each sample with its own."""
    first = make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, num_workers=2,
                               attach={"teacher": sidecar}, **AUGMENTED)
    first.set_epoch(1)
    seen = []
    for i, batch in enumerate(first):
        seen += batch["keys"]
        if i == 1:
            break
    state = first.state_dict()
    first.close()
    for rank in range(2):
        loader = make_stream_loader(sa1b_dataset, "train", batch_size=2, seed=5, rank=rank, world_size=2,
                                    attach={"teacher": sidecar}, **AUGMENTED)
        loader.load_state_dict(state)
        for batch in loader:
            assert torch.equal(batch["teacher"], teacher(batch["images"]))
            seen += batch["keys"]
    assert len(seen) == len(set(seen)) == 8  # (the 5 left over 2 ranks in batches of 2: 1 dropped)


def test_a_bad_record_is_skipped_and_counted_with_on_error_skip(sa1b_dataset: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bad"
    write(str(out), sa1b_dataset, epochs=(0,), hflip=0.0, scale_jitter=None)
    chunk = sorted((out / "all").glob("r00000-*.tar"))[0]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF  # (the first record's first header: its checksum no longer matches)
    chunk.write_bytes(bytes(data))
    settings = dict(batch_size=3, drop_last=False, image_size=64, mask_size=8, attach={"teacher": str(out)})
    with pytest.raises(ShardstreamError, match="r00000-000000.tar"):
        list(make_stream_loader(sa1b_dataset, "train", **settings))
    loader = make_stream_loader(sa1b_dataset, "train", on_error="skip", **settings)
    rows = sum(len(batch["keys"]) for batch in loader)
    assert loader.skipped == 1 and rows == len(split_keys(sa1b_dataset)) - 1


def _hf_attached(vqa: str, sidecar: str, out: str, *, stop: int | None = None,
                 resume: str | None = None) -> list[str]:
    """HF Trainer over `trainer_dataset` with the sidecar attached, `resume_callback`, 2 epochs (stopped
    after step `stop`, or resumed from `resume`): each trained sample's attached value, checked as its own."""
    from transformers import Trainer, TrainingArguments

    from pipeline import resume_callback, trainer_dataset

    collated: list[str] = []  # (accelerate collates a batch ahead: what is trained is what reaches the model)
    trained: list[str] = []

    def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        for s in samples:
            assert s["tag"] == f"{s['keys']}/{int(s['question_index'])}"
        collated.extend(s["tag"] for s in samples)
        return {"ids": torch.arange(len(collated) - len(samples), len(collated))}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
            trained.extend(collated[i] for i in ids.tolist())
            return {"loss": (self.weight - 1) ** 2}

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, num_train_epochs=2, use_cpu=True,
                             remove_unused_columns=False, report_to="none", disable_tqdm=True, logging_steps=1000,
                             save_strategy="steps" if stop else "no", save_steps=stop or 500, max_steps=stop or -1)
    ds = trainer_dataset(vqa, "train", batch_size=2, seed=3, image_size=16, attach={"tag": sidecar})
    trainer = Trainer(model=Model(), args=args, train_dataset=ds, data_collator=collate,
                      callbacks=[resume_callback(ds)])
    trainer.train(resume_from_checkpoint=resume)
    return trained


@pytest.mark.slow
def test_hf_trainer_resumed_mid_epoch_trains_each_sample_with_its_own_output(vqa: str, tmp_path: pathlib.Path) -> None:
    out = str(tmp_path / "tags")
    loader = make_stream_loader(vqa, "train", batch_size=4, drop_last=False, image_size=16)
    with OutputWriter(out, loader) as writer:
        for batch in loader:
            writer.write(batch["keys"], {"tag": [f"{k}/{int(q)}" for k, q in zip(batch["keys"],
                                                                                 batch["question_index"])]})
    whole = _hf_attached(vqa, out, str(tmp_path / "whole"))
    first = _hf_attached(vqa, out, str(tmp_path / "run"), stop=3)
    rest = _hf_attached(vqa, out, str(tmp_path / "run"), resume=str(tmp_path / "run" / "checkpoint-3"))
    assert first + rest == whole and len(whole) > 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_every_fixed_dtype_comes_back_exactly(sa1b_dataset: str, tmp_path: pathlib.Path, dtype: torch.dtype) -> None:
    out = str(tmp_path / "dtype")
    settings = dict(batch_size=3, drop_last=False, image_size=64, mask_size=8)
    loader = make_stream_loader(sa1b_dataset, "train", **settings)

    def value(images: torch.Tensor) -> torch.Tensor:
        return (teacher(images).float() * 1000 - 3).to(dtype)

    with OutputWriter(out, loader, inputs=("images",)) as writer:
        for batch in loader:
            writer.write(batch["keys"], {"value": value(batch["images"])})
    for batch in make_stream_loader(sa1b_dataset, "train", **settings, num_workers=1, attach={"value": out}):
        assert batch["value"].dtype == dtype and torch.equal(batch["value"], value(batch["images"]))


def test_a_restart_with_other_samples_is_refused_before_the_manifest_exists(sa1b_dataset: str,
                                                                              tmp_path: pathlib.Path) -> None:
    out = str(tmp_path / "other")
    loader = make_stream_loader(sa1b_dataset, "train", batch_size=3, drop_last=False, seed=5, **AUGMENTED)
    with OutputWriter(out, loader, inputs=("images",), chunk_bytes=1) as writer:
        batch = next(iter(loader))
        writer.write(batch["keys"], {"teacher": teacher(batch["images"])})
    again = make_stream_loader(sa1b_dataset, "train", batch_size=3, drop_last=False, seed=5,
                               **{**AUGMENTED, "hflip": 0.25})
    with pytest.raises(ConfigError, match=r"epoch-000000 was being written from other samples than this loader's: "
                                          r"kind options \(hflip: 0.5 there, 0.25 here\)"):
        with OutputWriter(out, again, inputs=("images",)):
            pass
