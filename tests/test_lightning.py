"""Resuming through the real Lightning (lightning.pytorch on CPU, offline, no mocks): a checkpoint taken
mid-epoch, by `ModelCheckpoint` or by `trainer.save_checkpoint`, resumed by a fresh Trainer, loader
and module, trains on exactly what an uninterrupted run trains after that point, in its order, and
decodes only that (nothing replayed, nothing read up to the position). Two ways to feed Lightning:
`make_stream_loader` (its `state_dict`, `len()` and `sampler.set_epoch`) and torchdata's
`StatefulDataLoader` over `trainer_dataset` (the dataset's `state_dict` in each worker, its epoch set
by the module), on 1 process and on 2 (DDP, gloo on 127.0.0.1, launched by torchrun). Checkpoints at
an epoch's end, and one saved after `fit` returns, are tested against Lightning's own contract.

Run as a script, this file is what each torchrun process runs (`_main`).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from pipeline import make_stream_loader, trainer_dataset
from pipeline.kinds.sa1b import Sa1b
from conftest import split_keys
from procs import end_process_group, torchrun

SEED = 5
BATCH = 2
SMALL = {"image_size": 32, "mask_size": 16, "max_masks": 2}
STREAM = "stream_loader"
STATEFUL = "stateful_dataloader"  # the epoch set in on_train_epoch_start (docs/trainers.md)
STATEFUL_AT_SETUP = "stateful_dataloader_epoch_at_setup"  # ... and in train_dataloader, before Lightning's first iter()
WAYS = (STREAM, STATEFUL, STATEFUL_AT_SETUP)

# Where `Sa1b.decode` appends the key of each sample it decodes (None: nowhere). Read at each call, so
# the DataLoader workers of a run keep the file of the run that forked them.
_DECODES: dict[str, str | None] = {"path": None}
_decode = Sa1b.decode


def _counted_decode(self: Sa1b, members: dict[str, bytes], *, key: str, **kwargs: Any) -> dict[str, Any]:
    if _DECODES["path"] is not None:
        with open(_DECODES["path"], "a") as f:  # (one short O_APPEND write per sample: workers do not interleave)
            f.write(key + "\n")
    return _decode(self, members, key=key, **kwargs)


def _decoded(path: str | pathlib.Path) -> list[str]:
    path = pathlib.Path(path)
    return path.read_text().split() if path.exists() else []


# -- the ways, the module, the trainer -------------------------------------------------------------


def _keys(samples: list[dict[str, Any]]) -> list[str]:
    """The StatefulDataLoader's collate_fn: each sample's key."""
    return [s["keys"] for s in samples]


def _loader(way: str, root: str) -> Any:
    """The training loader of `way`, on torch.distributed's rank (or rank 0 of 1), with 2 workers."""
    if way == STREAM:
        return make_stream_loader(root, "train", batch_size=BATCH, num_workers=2, seed=SEED, **SMALL)
    dataset = trainer_dataset(root, "train", batch_size=BATCH, shard_ranks=True, seed=SEED, **SMALL)
    return StatefulDataLoader(dataset, batch_size=BATCH, num_workers=2, collate_fn=_keys)


class _Probe(pl.LightningModule):
    """One scalar trained towards 1 whatever the batch; records the keys each step trains on, per
    epoch. Its loader is made in `train_dataloader` (in DDP, after torch.distributed is set up)."""

    def __init__(self, way: str, root: str) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.way, self.root = way, root
        self.loader: Any = None
        self.seen: dict[int, list[str]] = {}

    def train_dataloader(self) -> Any:
        self.loader = _loader(self.way, self.root)
        if self.way == STATEFUL_AT_SETUP:
            # Lightning makes this loader's first iterator (whose workers start reading at once) before
            # on_train_epoch_start; `processed` is the epoch it is about to play (a restored one included).
            self.loader.dataset.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
        return self.loader

    def on_train_epoch_start(self) -> None:
        # Lightning sets the epoch of a loader's `sampler` (a StreamLoader is its own), never of a
        # dataset. `trainer.train_dataloader` is the loader `train_dataloader` returned.
        if self.way != STREAM:
            self.trainer.train_dataloader.dataset.set_epoch(self.current_epoch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        keys = batch["keys"] if isinstance(batch, dict) else batch
        self.seen.setdefault(self.current_epoch, []).extend(keys)
        return (self.weight - 1) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _release(probe: _Probe) -> None:
    """End the StreamLoader's persistent workers: Lightning only drops a loader that is not a DataLoader,
    and the garbage collector, freeing it in a cycle, makes torch wait 5 s per worker."""
    if probe.way == STREAM and probe.loader is not None:
        probe.loader.close()


class _Preempted(Exception):
    """The end of a run that saved its checkpoint and was then stopped from outside."""


class _SaveAndStop(pl.Callback):
    """`trainer.save_checkpoint(path)` after training step `step` (as a job's own preemption handler
    does), then the run ends by an exception."""

    def __init__(self, step: int, path: pathlib.Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise _Preempted


def _trainer(out: pathlib.Path, callbacks: list[pl.Callback] = (), **options: Any) -> pl.Trainer:
    checkpoints = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    settings = {"accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False, "enable_progress_bar": False,
                "enable_model_summary": False, "enable_checkpointing": checkpoints, "default_root_dir": str(out),
                **options}
    return pl.Trainer(callbacks=list(callbacks), **settings)


def _fit(way: str, root: str, out: pathlib.Path, ckpt_path: pathlib.Path | None = None,
         callbacks: list[pl.Callback] = (), **options: Any) -> tuple[pl.Trainer, _Probe]:
    probe = _Probe(way, root)
    trainer = _trainer(out, callbacks, **options)
    try:
        trainer.fit(probe, ckpt_path=ckpt_path)
    finally:
        _release(probe)
    return trainer, probe


def _flat(run: dict[int, list[str]]) -> list[str]:
    return [key for epoch in sorted(run) for key in run[epoch]]


def _split(run: dict[int, list[str]], n: int) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """(its first `n` samples, the rest), each per epoch."""
    head, tail = {}, {}
    for epoch in sorted(run):
        if run[epoch][:n]:
            head[epoch] = run[epoch][:n]
        if run[epoch][n:]:
            tail[epoch] = run[epoch][n:]
        n = max(0, n - len(run[epoch]))
    return head, tail


def _check(full: dict[int, list[str]], samples: int, first: dict[int, list[str]], resumed: dict[int, list[str]],
           decoded: list[str]) -> None:
    """`first` trained on the uninterrupted run's first `samples`, `resumed` on the rest of it, epoch by
    epoch and in its order, and decoded that only, each sample once."""
    assert _split(first, samples)[0] == _split(full, samples)[0]
    assert resumed == _split(full, samples)[1], "the rest of the uninterrupted run, in its epochs and order"
    assert sorted(decoded) == sorted(_flat(resumed)), "decoded after the restore: what was trained on, once each"


def _plan(root: str, epoch: int, rank: int = 0, world_size: int = 1) -> list[str]:
    """The loader's own order for (SEED, epoch) on a rank: what Lightning must train on there."""
    loader = make_stream_loader(root, "train", batch_size=BATCH, num_workers=0, seed=SEED, rank=rank,
                                world_size=world_size, **SMALL)
    loader.set_epoch(epoch)
    return [key for batch in loader for key in batch["keys"]]


@pytest.fixture(scope="module")
def uninterrupted(sa1b_dataset, tmp_path_factory):
    """way -> what an uninterrupted 2-epoch run trains on, per epoch (each way run once per module)."""
    runs: dict[str, dict[int, list[str]]] = {}

    def run(way: str) -> dict[int, list[str]]:
        if way not in runs:
            _, probe = _fit(way, sa1b_dataset, tmp_path_factory.mktemp(f"lightning-{way}"))
            runs[way] = probe.seen
            assert probe.seen == {e: _plan(sa1b_dataset, e) for e in (0, 1)}, "the loader's order, every epoch"
            assert probe.seen[0] != probe.seen[1], "each epoch its own order"
        return runs[way]

    return run


@pytest.fixture
def decodes(monkeypatch, tmp_path):
    """Counts what `Sa1b.decode` decodes, in this process and in the DataLoader workers forked after
    this: call it with a name to start a new count, in a file; it returns the file."""
    monkeypatch.setattr(Sa1b, "decode", _counted_decode)
    monkeypatch.setitem(_DECODES, "path", None)

    def start(name: str) -> pathlib.Path:
        _DECODES["path"] = str(tmp_path / f"decoded-{name}.txt")
        return pathlib.Path(_DECODES["path"])

    return start


def _resume(way: str, root: str, out: pathlib.Path, ckpt: pathlib.Path,
            decodes: Any) -> tuple[pl.Trainer, _Probe, list[str]]:
    """A fresh module, loader and Trainer fitted from `ckpt`: (trainer, module, the keys it decoded)."""
    decoded = decodes("resumed")
    trainer, probe = _fit(way, root, out, ckpt_path=ckpt)
    return trainer, probe, _decoded(decoded)


# -- one process -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("how", ["ModelCheckpoint", "save_checkpoint"])
@pytest.mark.parametrize("step", [1, 3, 6])
def test_a_mid_epoch_checkpoint_resumes_exactly(way, how, step, sa1b_dataset, uninterrupted, decodes, tmp_path):
    full = uninterrupted(way)
    per_epoch = len(full[0]) // BATCH
    assert step % per_epoch, "mid-epoch"
    if how == "ModelCheckpoint":  # the first run ends with max_steps, after the callback's checkpoint at that step
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=step, save_top_k=-1)
        _, first = _fit(way, sa1b_dataset, tmp_path, callbacks=[saver], max_steps=step)
        (ckpt,) = (tmp_path / "ckpt").iterdir()
    else:  # the first run saves by itself mid-epoch, then ends as a preempted job does
        ckpt = tmp_path / "preempted.ckpt"
        first = _Probe(way, sa1b_dataset)
        with pytest.raises(_Preempted):
            _trainer(tmp_path, [_SaveAndStop(step, ckpt)]).fit(first)
        _release(first)
    assert len(_flat(first.seen)) == step * BATCH
    trainer, resumed, decoded = _resume(way, sa1b_dataset, tmp_path, ckpt, decodes)
    _check(full, step * BATCH, first.seen, resumed.seen, decoded)
    # Lightning stops an epoch at len(loader) (limit_train_batches=1.0, no validation): the whole epoch's.
    assert trainer.num_training_batches == len(resumed.loader) == per_epoch
    if way == STREAM:
        assert resumed.loader.stats().samples == len(decoded), "the loader's own count of the samples it decoded"


_LIGHTNING_EMPTY_EPOCH = pytest.mark.xfail(strict=True, reason=(
    "Lightning 2.6: a checkpoint saved on an epoch's last batch resumes into the next epoch with the "
    "StatefulDataLoader's state of the finished one: it yields nothing, that epoch trains on no batch "
    "(any dataset: also a list in a StatefulDataLoader), and on_train_epoch_start is not called for it"))
_LIGHTNING_ITER_BEFORE_EPOCH = pytest.mark.xfail(strict=True, reason=(
    "Lightning 2.6 makes the first iterator of a fit (StatefulDataLoader workers start the dataset's "
    "iteration) before on_train_epoch_start: resumed at an epoch's start, the dataset plays the epoch it "
    "was made with (0) in that epoch; set it in train_dataloader"))


@pytest.mark.slow
@pytest.mark.parametrize(("way", "when"), [
    (STREAM, "last batch"), (STREAM, "epoch end"),
    pytest.param(STATEFUL, "last batch", marks=_LIGHTNING_EMPTY_EPOCH),
    pytest.param(STATEFUL, "epoch end", marks=_LIGHTNING_ITER_BEFORE_EPOCH),
    pytest.param(STATEFUL_AT_SETUP, "last batch", marks=_LIGHTNING_EMPTY_EPOCH),
    (STATEFUL_AT_SETUP, "epoch end"),
])
def test_a_checkpoint_at_an_epoch_boundary_resumes_exactly(way, when, sa1b_dataset, uninterrupted, decodes, tmp_path):
    full = uninterrupted(way)
    per_epoch = len(full[0]) // BATCH
    if when == "last batch":  # on_train_batch_end of the epoch's last batch: Lightning has not ended the epoch
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=per_epoch, save_top_k=-1)
        _, first = _fit(way, sa1b_dataset, tmp_path, callbacks=[saver], max_steps=per_epoch)
    else:  # ModelCheckpoint's default: at on_train_epoch_end
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1)
        _, first = _fit(way, sa1b_dataset, tmp_path, callbacks=[saver], max_epochs=1)
    (ckpt,) = (tmp_path / "ckpt").iterdir()
    _, resumed, decoded = _resume(way, sa1b_dataset, tmp_path, ckpt, decodes)
    _check(full, per_epoch * BATCH, first.seen, resumed.seen, decoded)


@pytest.mark.slow
@pytest.mark.parametrize("way", [STREAM, pytest.param(STATEFUL, marks=_LIGHTNING_ITER_BEFORE_EPOCH), STATEFUL_AT_SETUP])
def test_save_checkpoint_after_fit_returns_resumes_at_the_next_epoch(way, sa1b_dataset, uninterrupted, decodes,
                                                                     tmp_path):
    """`fit(max_steps=k)` ending mid-epoch runs the epoch's end before returning (`on_train_epoch_end`,
    the epoch counted as processed): a checkpoint saved then is of a finished epoch, and Lightning
    resumes at the next one. The rest of the interrupted epoch is never trained on (Lightning's
    choice), and never decoded."""
    full = uninterrupted(way)
    trainer, first = _fit(way, sa1b_dataset, tmp_path, max_steps=2)
    trainer.save_checkpoint(tmp_path / "after-fit.ckpt")
    if way != STREAM:
        # fit's teardown dropped the StatefulDataLoader's iterator, so its state_dict() above began a new one:
        # workers that read the epoch's first batches to save the state of its start. Let them go now.
        first.loader.load_state_dict({})
    assert first.seen == {0: full[0][: 2 * BATCH]}
    _, resumed, decoded = _resume(way, sa1b_dataset, tmp_path, tmp_path / "after-fit.ckpt", decodes)
    assert resumed.seen == {1: full[1]}
    assert sorted(decoded) == sorted(full[1])


# -- two processes: DDP under torchrun -------------------------------------------------------------

DDP_STEPS = (1, 2, 3)  # checkpoints resumed (2 batches per rank and epoch): in epoch 0, at its last batch, in epoch 1


def _epochs(run: dict[str, list[str]]) -> dict[int, list[str]]:
    return {int(epoch): keys for epoch, keys in run.items()}


@pytest.fixture(scope="module")
def ddp(sa1b_dataset, tmp_path_factory):
    """way -> (what each of the 2 torchrun processes recorded, their folder): the uninterrupted run, the
    run checkpointing at each of DDP_STEPS, and a fresh run resumed from each (each way run once per module)."""
    runs: dict[str, tuple[list[dict[str, Any]], pathlib.Path]] = {}

    def run(way: str) -> tuple[list[dict[str, Any]], pathlib.Path]:
        if way not in runs:
            out = tmp_path_factory.mktemp(f"ddp-{way}")
            torchrun(__file__, 2, "first", way, sa1b_dataset, str(out))
            torchrun(__file__, 2, "resume", way, sa1b_dataset, str(out))
            runs[way] = [json.loads((out / f"{way}-{rank}.json").read_text()) for rank in range(2)], out
        return runs[way]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("way", [STREAM, STATEFUL])
def test_ddp_uninterrupted_run_trains_every_sample_once_in_each_ranks_plan(way, sa1b_dataset, ddp):
    ranks, _ = ddp(way)
    full = [_epochs(r["full"]) for r in ranks]
    split = split_keys(sa1b_dataset)
    for rank in range(2):
        assert full[rank] == {e: _plan(sa1b_dataset, e, rank, 2) for e in (0, 1)}, "each rank: its plan, in order"
    for epoch in (0, 1):  # every sample of the epoch's plan once, over the ranks
        trained = [k for f in full for k in f[epoch]]
        assert len(trained) == len(set(trained)) == len(split) - len(split) % (2 * BATCH) and set(trained) <= set(split)
    assert full[0][0] != full[0][1]


@pytest.mark.slow
@pytest.mark.parametrize(("way", "step"), [
    (STREAM, 1), (STREAM, 2), (STREAM, 3),
    (STATEFUL, 1), pytest.param(STATEFUL, 2, marks=_LIGHTNING_EMPTY_EPOCH), (STATEFUL, 3),
])
def test_ddp_mid_epoch_resume_trains_every_sample_once(way, step, ddp):
    """Resumed from the checkpoint of step `step` (2 batches per rank and epoch: in epoch 0, at its last
    batch, in epoch 1), each rank trains on the rest of its uninterrupted run and decodes only that."""
    ranks, _ = ddp(way)
    full = [_epochs(r["full"]) for r in ranks]
    for rank, run in enumerate(ranks):
        resumed = run["resumed"][str(step)]
        _check(full[rank], step * BATCH, _epochs(run["first"]), _epochs(resumed["seen"]), resumed["decoded"])
        assert resumed["batches"] == [len(full[rank][0]) // BATCH] * 2, "len() and Lightning's count, per rank"
    for epoch in (0, 1):  # over the ranks, what the two runs trained on: nothing twice, nothing lost
        trained = [k for run in ranks for k in _split(_epochs(run["first"]), step * BATCH)[0].get(epoch, [])]
        trained += [k for run in ranks for k in _epochs(run["resumed"][str(step)]["seen"]).get(epoch, [])]
        assert sorted(trained) == sorted(k for f in full for k in f[epoch]) and len(set(trained)) == len(trained)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumed_on_one_process_takes_the_samples_no_rank_had(sa1b_dataset, ddp, decodes, tmp_path):
    """The 2-process checkpoint of step 1, resumed on 1 process: the samples no rank had taken, then
    whole epochs in the new world."""
    ranks, out = ddp(STREAM)
    split = split_keys(sa1b_dataset)
    (ckpt,) = (out / "ckpt").glob("epoch=*-step=1.ckpt")
    _, alone, decoded = _resume(STREAM, sa1b_dataset, tmp_path / "alone", ckpt, decodes)
    taken = [k for run in ranks for k in _epochs(run["first"])[0][:BATCH]]
    rest = len(split) - len(split) % (2 * BATCH) - len(taken)  # (those of the 2-rank epoch, less the
    rest -= rest % BATCH                                       # 1-process epoch's own remainder)
    assert len(alone.seen[0]) == rest and not set(alone.seen[0]) & set(taken)
    assert len(set(alone.seen[0])) == rest and set(alone.seen[0]) <= set(split)
    assert alone.seen[1] == _plan(sa1b_dataset, 1), "then whole epochs in the new world"
    assert sorted(decoded) == sorted(_flat(alone.seen))


def _rank(phase: str, way: str, root: str, out: str) -> None:
    """One torchrun process: "first", the uninterrupted run and a run checkpointing at each of the
    first DDP_STEPS steps; "resume", a fresh run from each of those checkpoints. What it trained on
    (and, resumed, decoded) goes to `{out}/{way}-{rank}.json`."""
    rank, out_dir = int(os.environ["RANK"]), pathlib.Path(out)
    ddp = {"strategy": "ddp", "devices": 2}
    results = out_dir / f"{way}-{rank}.json"
    if phase == "first":
        _, full = _fit(way, root, out_dir / "full", **ddp)
        saver = ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_train_steps=1, save_top_k=-1)
        _, first = _fit(way, root, out_dir / "first", callbacks=[saver], max_steps=max(DDP_STEPS), **ddp)
        results.write_text(json.dumps({"full": full.seen, "first": first.seen}))
        return
    Sa1b.decode = _counted_decode
    record = json.loads(results.read_text())
    record["resumed"] = {}
    for step in DDP_STEPS:  # (a StatefulDataLoader's at an epoch's last batch: Lightning's to lose, pinned above)
        (ckpt,) = (out_dir / "ckpt").glob(f"epoch=*-step={step}.ckpt")
        decoded = out_dir / f"decoded-{way}-{step}-{rank}.txt"
        _DECODES["path"] = str(decoded)
        trainer, probe = _fit(way, root, out_dir / "resumed", ckpt_path=ckpt, **ddp)
        _DECODES["path"] = None
        record["resumed"][step] = {"seen": probe.seen, "decoded": _decoded(decoded),
                                   "batches": [len(probe.loader), trainer.num_training_batches]}
    results.write_text(json.dumps(record))


def _main(argv: list[str]) -> int:
    _rank(*argv)
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
