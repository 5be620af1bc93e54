"""GRPO on the questions of a packed VQA split with TRL: every question once per epoch, as
`num_generations` completions in one group, in the loader's order for (seed, epoch).

    python examples/grpo_vqa.py MODEL SHARDS OUT --epochs 2                       # one process
    python examples/grpo_vqa.py Qwen/Qwen2-VL-2B-Instruct SHARDS OUT --image-size none --max-pixels 200704
    torchrun --nproc-per-node 8 examples/grpo_vqa.py MODEL SHARDS OUT --epochs 2  # or: accelerate launch ...

`tests/test_trainers.py` runs this with a tiny LLaVA built offline, on 1 and 2 processes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed
from trl import GRPOConfig, GRPOTrainer

from pipeline import resume_callback, trl_dataset


def exact_match(completions: list[list[dict[str, str]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion is the answer, case and surrounding space aside."""
    return [float(c[0]["content"].strip().lower() == a.strip().lower()) for c, a in zip(completions, answer)]


def make_trainer(model: Any, shards: str, output_dir: str, *, epochs: int = 1, batch_size: int = 8,
                 num_generations: int = 4, image_size: int | None = 448, seed: int = 0,
                 pixels: dict[str, int] | None = None,
                 reward_funcs: Sequence[Callable[..., list[float]]] = (exact_match,), callbacks: Sequence[Any] = (),
                 **config: Any) -> GRPOTrainer:
    """A GRPOTrainer over the split "train" of `shards` for `epochs` epochs (`config`: more GRPOConfig),
    which `trainer.train(resume_from_checkpoint=...)` resumes at the next question, none decoded twice.
    `pixels`: a pixel budget with `image_size=None` (`min_pixels`, `max_pixels`, `pixel_factor`: the
    images at Qwen2-VL's `smart_resize` of their original size, which its processor then keeps)."""
    train = trl_dataset(shards, "train", image_size=image_size, seed=seed, **(pixels or {}))
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=batch_size, num_generations=num_generations,
                      shuffle_dataset=False,  # trl_dataset shuffles the whole split by (seed, epoch) itself
                      seed=seed, **config)
    # An iterable dataset has no length: the steps of an epoch come from the question count. TRL
    # leaves out an epoch's last generation round when fewer questions than one round remain.
    questions = train.info.splits["train"].num_examples
    rounds = questions // (args.generation_batch_size // num_generations)
    steps = rounds * args.num_iterations * args.steps_per_generation // args.gradient_accumulation_steps
    args.max_steps = epochs * steps
    if args.process_index == 0:
        print(f"{questions} questions: {rounds * args.generation_batch_size // num_generations} per epoch in "
              f"{steps} steps of {args.generation_batch_size} completions, {epochs} epochs")
    return GRPOTrainer(model=model, reward_funcs=list(reward_funcs), train_dataset=train, args=args,
                       callbacks=[resume_callback(train), *callbacks])


def _size(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a vision-language model: hub name or local folder")
    parser.add_argument("shards", help="a VQA dataset packed by `shard-pack vqa` (folder or URL)")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per process per step (8)")
    parser.add_argument("--generations", type=int, default=4, help="completions per question (4)")
    parser.add_argument("--image-size", type=_size, default=448, help="long side (448); none: as stored or budgeted")
    for flag in ("--min-pixels", "--max-pixels", "--pixel-factor"):
        parser.add_argument(flag, type=int, help="Qwen2-VL's pixel budget, with --image-size none")
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU in float32")
    parser.add_argument("--save-steps", type=int, help="save a checkpoint every this many steps (default: none)")
    parser.add_argument("--resume", help="a checkpoint folder (OUT/checkpoint-N) to resume from")
    args = parser.parse_args(argv)
    extra = {"use_cpu": True, "bf16": False} if args.cpu else {}
    pixels = {name: getattr(args, name) for name in ("min_pixels", "max_pixels", "pixel_factor")
              if getattr(args, name) is not None}
    trainer = make_trainer(args.model, args.shards, args.out, epochs=args.epochs, batch_size=args.batch_size,
                           num_generations=args.generations, image_size=args.image_size, pixels=pixels,
                           max_completion_length=args.max_completion_length, report_to="none",
                           save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, **extra)
    trainer.train(resume_from_checkpoint=args.resume)
    if torch.distributed.is_initialized():  # under torchrun: gloo may abort at exit if left up
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
