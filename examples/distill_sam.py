"""Distilling SAM's image encoder into a small student over a packed SA-1B split, in two phases:
`teacher` writes each image's SAM embedding into a sidecar (`pipeline.OutputWriter`), `student`
trains a few convolutions to regress it, the embeddings attached to their very images (`attach=`).

    python examples/distill_sam.py teacher SHARDS SIDECAR                       # facebook/sam-vit-huge
    torchrun --nproc-per-node 8 examples/distill_sam.py teacher SHARDS SIDECAR  # each rank its share
    torchrun --nproc-per-node 8 examples/distill_sam.py student SHARDS SIDECAR OUT --steps 20000 --save-every 1000
    torchrun --nproc-per-node 8 examples/distill_sam.py student SHARDS SIDECAR OUT --steps 20000 \\
        --resume OUT/step-00005000.pt                                          # the same batches from there

A teacher job stopped and started again writes only what it had not committed; a student run
resumed from a checkpoint (model, optimizer and the loader's position) takes exactly the batches
an uninterrupted run would have taken from there. `tests/test_distill_example.py` runs both phases
with a tiny random SAM built offline (`--tiny`), on 1 and 2 processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import OutputWriter, make_stream_loader

# SamProcessor's normalisation, on 0-255 pixels (ImageNet's mean and std).
SAM_MEAN = (123.675, 116.28, 103.53)
SAM_STD = (58.395, 57.12, 57.375)
FIELD = "teacher"  # the sidecar's field, and the batch key it is attached as


def normalize(images: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, S, S) images, each zero-padded beyond its `image_sizes` (h, w), as SAM takes them:
    float, normalised, and zero beyond each image (SamProcessor pads after normalising)."""
    mean = images.new_tensor(SAM_MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = images.new_tensor(SAM_STD, dtype=torch.float32).view(1, 3, 1, 1)
    x = (images.float() - mean) / std
    side = torch.arange(images.shape[-1], device=images.device)
    h, w = image_sizes[:, 0].view(-1, 1, 1), image_sizes[:, 1].view(-1, 1, 1)
    inside = (side.view(1, -1, 1) < h) & (side.view(1, 1, -1) < w)
    return x * inside[:, None]


def tiny_teacher(image_size: int, seed: int = 0) -> Any:
    """A small random SamModel for `image_size` (a multiple of 8), the same weights for a seed: for tests
    and trying the script offline. Its embedding is (32, image_size / 8, image_size / 8)."""
    from transformers import SamConfig, SamModel

    config = SamConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_dim=64, output_channels=32,
                           image_size=image_size, patch_size=8, window_size=4, global_attn_indexes=[1],
                           initializer_range=0.02),
        prompt_encoder_config=dict(hidden_size=32, image_size=image_size, patch_size=8, mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=32, mlp_dim=64, num_hidden_layers=1, num_attention_heads=2,
                                 iou_head_hidden_dim=32))
    torch.manual_seed(seed)
    return SamModel(config).eval()


def load_teacher(name: str, image_size: int, tiny: bool = False) -> Any:
    """SAM (`name`: a hub name or a local folder) or, with `tiny`, `tiny_teacher`; in eval mode."""
    if tiny:
        return tiny_teacher(image_size)
    from transformers import SamModel

    model = SamModel.from_pretrained(name).eval()
    if model.config.vision_config.image_size != image_size:
        raise SystemExit(f"{name} takes {model.config.vision_config.image_size}-pixel images; "
                         f"--image-size is {image_size}")
    return model


def write_teacher(shards: str, sidecar: str, teacher: Any, *, image_size: int = 1024, batch_size: int = 8,
                  num_workers: int = 4, device: str | None = None, split: str = "train") -> int:
    """Each image's teacher embedding (float16) into `sidecar`, this rank's share of `split`; the
    sidecar is complete once every rank's share is. No augmentation: one pass serves every epoch
    and seed. Started again after an interruption, it writes only what was not committed. Returns
    the embeddings written here."""
    loader = make_stream_loader(shards, split, batch_size=batch_size, drop_last=False, num_workers=num_workers,
                                device=device, image_size=image_size, mask_size=16, max_masks=0)
    written = 0
    with OutputWriter(sidecar, loader, inputs=("images", "image_sizes")) as writer:
        for batch in loader:
            with torch.no_grad():
                embeddings = teacher.get_image_embeddings(normalize(batch["images"], batch["image_sizes"]))
            writer.write(batch["keys"], {FIELD: embeddings.half()})
            written += len(batch["keys"])
    return written


class Student(nn.Module):
    """Strided 3x3 convolutions from the normalised image down to the embedding's grid, then a 1x1
    convolution to its channels."""

    def __init__(self, image_size: int, shape: Sequence[int], width: int = 64) -> None:
        super().__init__()
        channels, grid = shape[0], shape[-1]
        stages = math.log2(image_size / grid)
        if not stages.is_integer() or stages < 1:
            raise ValueError(f"image size {image_size} over embedding grid {grid}: want a power of 2 of at least 2")
        layers: list[nn.Module] = []
        for i in range(int(stages)):
            layers += [nn.Conv2d(3 if i == 0 else width, width, 3, stride=2, padding=1), nn.GELU()]
        layers.append(nn.Conv2d(width, channels, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def embedding_shape(sidecar: str) -> tuple[int, ...]:
    """The teacher embedding's shape, from the sidecar's manifest (`fields`, docs/format.md)."""
    with fsspec.open(sidecar.rstrip("/") + "/outputs.json", "rb") as f:
        fields = json.load(f)["fields"]
    shapes = [field["shape"] for field in fields if field["name"] == FIELD]
    if not shapes or shapes[0] is None:
        raise SystemExit(f"{sidecar}: no fixed field {FIELD!r} (fields: {[f['name'] for f in fields]})")
    return tuple(shapes[0])


def _save(path: str, state: dict[str, Any]) -> None:
    """A checkpoint, whole or not at all."""
    partial = f"{path}.partial"
    torch.save(state, partial)
    os.replace(partial, path)


def train_student(shards: str, sidecar: str, out: str, *, steps: int, save_every: int = 1000,
                  resume: str | None = None, image_size: int = 1024, batch_size: int = 8, lr: float = 1e-3,
                  num_workers: int = 4, device: str | None = None, seed: int = 0, split: str = "train",
                  log_every: int = 10) -> list[float]:
    """`steps` optimizer steps of MSE to the attached teacher embeddings (epochs follow one another),
    from scratch or from the checkpoint `resume`. Every `save_every` steps and at the last, rank 0
    saves `out/step-NNNNNNNN.pt`: the model, the optimizer and the loader's position. Returns this
    rank's loss at each step taken here."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    loader = make_stream_loader(shards, split, batch_size=batch_size, num_workers=num_workers, device=device,
                                seed=seed, image_size=image_size, mask_size=16, max_masks=0,
                                attach={FIELD: sidecar})
    torch.manual_seed(seed)
    student = Student(image_size, embedding_shape(sidecar)).to(device or "cpu")
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr)
    step, epoch = 0, 0
    if resume:
        checkpoint = torch.load(resume, map_location="cpu", weights_only=True)  # (plain tensors and data)
        student.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        loader.load_state_dict(checkpoint["loader"])  # the rest of its epoch, none decoded twice
        step, epoch = checkpoint["step"], checkpoint["loader"]["epoch"]
    model = nn.parallel.DistributedDataParallel(student) if distributed else student
    os.makedirs(out, exist_ok=True)
    losses = []
    while step < steps:
        loader.set_epoch(epoch)  # (the checkpoint's epoch resumes where it stopped)
        for batch in loader:
            loss = F.mse_loss(model(normalize(batch["images"], batch["image_sizes"])), batch[FIELD].float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            losses.append(loss.item())
            if rank == 0 and (step % log_every == 0 or step == steps):
                print(f"step {step} epoch {epoch} loss {losses[-1]:.6f}", flush=True)
            if rank == 0 and (step % save_every == 0 or step == steps):  # (after the batch: it counts as taken)
                _save(os.path.join(out, f"step-{step:08d}.pt"), {"model": student.state_dict(),
                      "optimizer": optimizer.state_dict(), "loader": loader.state_dict(), "step": step})
            if step == steps:
                break
        epoch += 1
    return losses


def _device(name: str | None) -> str | None:
    """The device of this process: `name` ("cpu", "cuda"; default: cuda when there is one), each
    torchrun process on the GPU of its local rank."""
    name = name or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("shards", help="an SA-1B dataset packed by `shard-pack sa1b` (folder or URL)")
    common.add_argument("sidecar", help="the teacher's outputs (folder or URL)")
    common.add_argument("--image-size", type=int, default=1024, help="long side, zero-padded square (1024, SAM's)")
    common.add_argument("--batch-size", type=int, default=8, help="images per process per step (8)")
    common.add_argument("--workers", type=int, default=4, help="DataLoader workers per process (4)")
    common.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when there is one")
    common.add_argument("--split", default="train")
    phases = parser.add_subparsers(dest="phase", required=True)
    teacher = phases.add_parser("teacher", parents=[common], help="write the teacher's image embeddings")
    teacher.add_argument("--model", default="facebook/sam-vit-huge", help="a SamModel: hub name or local folder")
    teacher.add_argument("--tiny", action="store_true", help="a tiny random SAM built offline instead (tests)")
    student = phases.add_parser("student", parents=[common], help="train a student on the attached embeddings")
    student.add_argument("out", help="checkpoint folder")
    student.add_argument("--steps", type=int, required=True, help="optimizer steps in all")
    student.add_argument("--save-every", type=int, default=1000, help="checkpoint every this many steps (1000)")
    student.add_argument("--resume", help="a checkpoint (OUT/step-N.pt) to go on from")
    student.add_argument("--lr", type=float, default=1e-3)
    student.add_argument("--seed", type=int, default=0, help="the student's order of batches and its initial weights")
    student.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    device = _device(args.device)
    started = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    if started:  # under torchrun: the loader takes its rank and world from torch.distributed
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        if args.phase == "teacher":
            model = load_teacher(args.model, args.image_size, tiny=args.tiny).to(device)
            written = write_teacher(args.shards, args.sidecar, model, image_size=args.image_size,
                                    batch_size=args.batch_size, num_workers=args.workers, device=device,
                                    split=args.split)
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}: {written} embeddings into "
                  f"{args.sidecar}", flush=True)
        else:
            train_student(args.shards, args.sidecar, args.out, steps=args.steps, save_every=args.save_every,
                          resume=args.resume, image_size=args.image_size, batch_size=args.batch_size, lr=args.lr,
                          num_workers=args.workers, device=device, seed=args.seed, split=args.split,
                          log_every=args.log_every)
    finally:
        if started:  # (gloo may abort at exit if left up)
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
