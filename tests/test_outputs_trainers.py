"""Attached outputs through the trainer integrations not covered in test_outputs (HF Trainer is):
Lightning fitting a `make_stream_loader` and torchdata's `StatefulDataLoader` over `trainer_dataset`,
each stopped mid-epoch and resumed from its checkpoint. Every step's attached output is the
teacher's output of that very step's images, and the two runs together train each sample of each
epoch once, the resumed one decoding only what it trains."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from pipeline import make_stream_loader, trainer_dataset
from conftest import split_keys
from test_outputs import AUGMENTED, teacher, write

BATCH = 2


@pytest.fixture(scope="module")
def outputs(sa1b_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The teacher's outputs of epochs 0 and 1 under hflip and scale jitter (test_outputs' sidecar)."""
    out = str(tmp_path_factory.mktemp("sidecar") / "teacher")
    write(out, sa1b_dataset, world=2)
    return out


class _Student(pl.LightningModule):
    """Records each step's keys, having checked its attached output against the teacher's."""

    def __init__(self, dataset: str, out: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.dataset, self.out = dataset, out
        self.loader: Any = None
        self.seen: list[str] = []

    def train_dataloader(self) -> Any:
        self.loader = make_stream_loader(self.dataset, "train", batch_size=BATCH, num_workers=2, seed=5,
                                         attach={"teacher": self.out}, **AUGMENTED)
        return self.loader

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert torch.equal(batch["teacher"], teacher(batch["images"]))  # bit for bit, this epoch's augmentation
        self.seen += batch["keys"]
        return (self.weight - 1) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(dataset: str, out: str, root: pathlib.Path, ckpt: pathlib.Path | None = None, **options: Any) -> _Student:
    student = _Student(dataset, out)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), **options)
    try:
        trainer.fit(student, ckpt_path=ckpt)
    finally:
        student.loader.close()
    return student


@pytest.mark.slow
def test_lightning_resumed_mid_epoch_trains_each_sample_with_its_own_output(sa1b_dataset: str, outputs: str,
                                                                            tmp_path: pathlib.Path) -> None:
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = _fit(sa1b_dataset, outputs, tmp_path, callbacks=[saver], max_steps=3)  # (mid-epoch 0: 4 a epoch)
    (ckpt,) = (tmp_path / "ckpt").iterdir()
    resumed = _fit(sa1b_dataset, outputs, tmp_path, ckpt)
    full = _fit(sa1b_dataset, outputs, tmp_path / "full", enable_checkpointing=False)
    assert first.seen + resumed.seen == full.seen  # (each epoch's order; 2 epochs of 4 batches)
    assert len(full.seen) == 2 * 4 * BATCH and set(full.seen) <= set(split_keys(sa1b_dataset))
    assert resumed.loader.stats().samples == len(resumed.seen), "decoded only what it trained"


def test_a_stateful_dataloader_resumed_mid_epoch_attaches_the_rest_exactly(sa1b_dataset: str, outputs: str) -> None:
    def loader() -> StatefulDataLoader:
        dataset = trainer_dataset(sa1b_dataset, "train", batch_size=BATCH, drop_last=False, seed=5,
                                  attach={"teacher": outputs}, **AUGMENTED)
        dataset.set_epoch(1)
        return StatefulDataLoader(dataset, batch_size=BATCH, num_workers=2,
                                  collate_fn=lambda rows: {k: [r[k] for r in rows] for k in rows[0]})

    def rows(batch: dict[str, list[Any]]) -> list[str]:
        for image, output in zip(batch["images"], batch["teacher"]):
            assert torch.equal(output, teacher(image[None])[0])
        return batch["keys"]

    first, seen = loader(), []
    for i, batch in enumerate(first):
        seen += rows(batch)
        if i == 1:
            state = first.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += rows(batch)
    assert sorted(seen) == sorted(split_keys(sa1b_dataset))
