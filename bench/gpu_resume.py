"""Lightning on a GPU, resumed mid-epoch: the loader's CUDA stage (pinned batches, non_blocking
copies one batch ahead on a side stream) under Lightning's checkpoints. Needs a GPU and lightning.

    python bench/gpu_resume.py [--images 96] [--workers 4]

Trains 2 epochs uninterrupted, then stops after a mid-epoch step (a checkpoint by
`trainer.save_checkpoint` at that batch's end, then the run killed) and resumes in a fresh Trainer; prints whether the resumed run trained
exactly the uninterrupted run's samples after that step, on the device, and the batches the
loader yielded after the restore (the rest of the epoch, nothing replayed).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from pipeline import make_stream_loader  # noqa: E402
from shard_tools.pack import PackOptions, pack  # noqa: E402
from shard_tools.sa1b import Sa1bSource  # noqa: E402
from shard_tools.samples.sa1b import write_sa1b  # noqa: E402


def _module(record: dict[int, list[str]], cuda: bool):
    import lightning.pytorch as pl

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def training_step(self, batch, batch_idx):
            assert batch["images"].is_cuda == batch["masks"].is_cuda == cuda, "batches arrive on the GPU"
            record.setdefault(self.current_epoch, []).extend(batch["keys"])
            return (self.weight - batch["images"].float().mean()) ** 2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Probe()


class _Killed(Exception):
    pass


def _fit(root: str, workers: int, cuda: bool, ckpt: str | None = None, stop: int | None = None,
         save: str | None = None) -> tuple[dict[int, list[str]], int]:
    import lightning.pytorch as pl

    class SaveAndDie(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == stop:
                trainer.save_checkpoint(save)
                raise _Killed

    record: dict[int, list[str]] = {}
    loader = make_stream_loader(root, "train", batch_size=8, num_workers=workers, seed=1,
                                device="cuda" if cuda else None, image_size=256, mask_size=64, max_masks=16)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[SaveAndDie()] if stop else [])
    try:
        trainer.fit(_module(record, cuda), loader, ckpt_path=ckpt)
    except _Killed:
        pass
    return record, loader.remaining


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cpu", action="store_true", help="the same on the CPU (checks the script without a GPU)")
    args = parser.parse_args()
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("needs CUDA (or --cpu)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        src, out = pathlib.Path(tmp) / "src", pathlib.Path(tmp) / "out"
        write_sa1b(src, images=args.images, size=(480, 640), masks=(8, 40), images_per_archive=32, seed=3)
        pack(Sa1bSource(), [str(src)], str(out), PackOptions(shard_samples=16), progress=False)
        start = time.perf_counter()
        whole, _ = _fit(str(out), args.workers, cuda)
        per_epoch = len(whole[0]) // 8
        stop = per_epoch // 2 + 1
        ckpt = str(pathlib.Path(tmp) / "mid.ckpt")
        first, _ = _fit(str(out), args.workers, cuda, stop=stop, save=ckpt)
        resumed, _ = _fit(str(out), args.workers, cuda, ckpt=ckpt)
        flat = [k for epoch in sorted(whole) for k in whole[epoch]]
        got = [k for run in (first, resumed) for epoch in sorted(run) for k in run[epoch]]
        after = sum(map(len, resumed.values()))
        device = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"{device}: {per_epoch} batches an epoch, stopped after step {stop}; "
              f"resumed run trained {after} samples (expected {len(flat) - 8 * stop}); "
              f"exact: {got == flat}; {time.perf_counter() - start:.1f} s")
        return 0 if got == flat and after == len(flat) - 8 * stop else 1


if __name__ == "__main__":
    raise SystemExit(main())
