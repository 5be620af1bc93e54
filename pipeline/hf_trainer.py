"""HF Trainer's side of `pipeline.resume_callback` (needs transformers): a `TrainerCallback` that
resumes a `trainer_dataset` mid-epoch at the exact next sample, positioned from the trainer's own
state (the global step), instead of HF's data skip, which decodes the epoch's trained batches again.

HF Trainer, resuming, skips `steps_trained_in_current_epoch` batches of the epoch by iterating
them (accelerate's `skip_first_batches`). The callback turns that off (`ignore_data_skip`), and
when training begins it puts the dataset where those batches end: every micro-batch of the trainer
is one global batch of the dataset (`trainer_dataset` deals them out so), so the epoch and the
batches taken in it follow from the global step as HF reckons them. What the checkpoint was made
of (dataset, split, order, kind options, global batch) travels in its `trainer_state.json`, under
`stateful_callbacks["shardstream"]` (kept there as plain data), and a resume with another is refused.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from pipeline.errors import ConfigError
from pipeline.plan import Resume, rank_batch_count
from pipeline.state import check_identity, differences

__all__ = ["StreamResume"]

log = logging.getLogger(__name__)
KEY = "shardstream"  # its entry in the checkpoint's TrainerState.stateful_callbacks


class StreamResume(TrainerCallback):
    """Positions `dataset` (a `trainer_dataset`, or a `trl_dataset` under TRL's GRPOTrainer) from the
    trainer's state when training begins."""

    def __init__(self, dataset: Any) -> None:
        pair = getattr(dataset, "shardstream", None)  # (a trl_dataset: its stream and where it starts)
        if pair is not None:
            self.stream, self.start = pair
        elif callable(getattr(dataset, "state_dict", None)) and hasattr(dataset, "identity"):
            self.stream, self.start = dataset, None
        else:
            raise ConfigError(f"resume_callback takes a dataset of trainer_dataset or trl_dataset, got "
                              f"{type(dataset).__name__}")
        self._offset: tuple[int, int, int] | None = None  # (epoch, micro-batches before the resume, in the epoch)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        args.ignore_data_skip = True  # the dataset starts where the checkpoint left off: nothing to skip

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        batching = self._batching(args, train_dataloader)
        here = {**self.stream.identity, "batching": batching}
        saved = state.stateful_callbacks.get(KEY)
        state.stateful_callbacks[KEY] = here  # (what every checkpoint of this run is of)
        if state.global_step == 0:
            return
        if saved is None:
            log.warning("the checkpoint has no record of its dataset (it was saved without resume_callback): "
                        "resuming at global step %d of this dataset, unchecked", state.global_step)
        else:
            _check(saved, here, self.stream.option_defaults)
        micro = state.global_step * args.gradient_accumulation_steps  # micro-batches trained
        if self.start is None:
            self._position(micro, batching["batches per epoch"], args.gradient_accumulation_steps)
        else:
            self._position_trl(micro, batching)

    def _batching(self, args: Any, loader: Any) -> dict[str, int]:
        """What decides how far a global step goes in the dataset (a checkpoint must share it)."""
        accumulate = args.gradient_accumulation_steps
        if self.start is not None:  # TRL: each micro-batch is one generation batch, `repeats` times each
            return {"gradient_accumulation_steps": accumulate,
                    "questions per generation round": args.generation_batch_size // args.num_generations,
                    "micro-batches per round": args.num_iterations * args.steps_per_generation}
        ds = self.stream
        steps = len(loader)  # HF's micro-batches per epoch: one global batch of the dataset each
        batches = rank_batch_count(ds.total, ds.world_size, ds.rank, ds.config.batch_size, ds.config.drop_last)
        if steps != batches:
            raise ConfigError(f"the trainer takes {steps} batches an epoch, the dataset has {batches} global "
                              "batches: make it with trainer_dataset(..., batch_size=args.per_device_train_batch_size, "
                              "world_size=args.world_size)")
        return {"gradient_accumulation_steps": accumulate, "batches per epoch": steps,
                "global batch": args.per_device_train_batch_size * args.world_size}

    def _position(self, micro: int, steps: int, accumulate: int) -> None:
        """A trainer_dataset: the epoch and its batches taken, as HF reckons epochs."""
        per_epoch = max(steps // accumulate + int(steps % accumulate > 0), 1)
        epoch, done = divmod(micro // accumulate, per_epoch)
        done *= accumulate
        if done and steps % accumulate:
            raise ConfigError(f"cannot resume mid-epoch exactly: gradient_accumulation_steps={accumulate} does not "
                              f"divide the epoch's {steps} batches, and HF Trainer, told not to skip, would not "
                              "step on the epoch's last partial accumulation; resume from an epoch's end, or without "
                              "resume_callback (HF then skips the trained batches by decoding them again)")
        ds = self.stream
        ds.state.set(epoch, (Resume(ds.world_size, done),) if done else ())
        self._offset = (epoch, done, steps) if done else None
        log.info("resuming at epoch %d after %d of its %d batches", epoch, done, steps)

    def _position_trl(self, micro: int, batching: dict[str, int]) -> None:
        """A trl_dataset: TRL repeats each generation round's questions for its micro-batches, and an
        epoch is the whole rounds its questions fill; HF counts epochs from 0 again after a resume."""
        prompts, repeats = batching["questions per generation round"], batching["micro-batches per round"]
        if micro % repeats:
            raise ConfigError(f"cannot resume exactly inside a generation round (after {micro % repeats} of its "
                              f"{repeats} micro-batches): TRL regenerates the round's completions on resuming; "
                              "save on rounds' ends (save_steps a multiple of num_iterations x steps_per_generation / "
                              "gradient_accumulation_steps)")
        rounds = len(self.stream) // prompts
        self.start.epoch, done = divmod(micro // repeats, rounds)
        self.start.taken = done * prompts
        log.info("resuming at epoch %d after %d of its %d questions", self.start.epoch, self.start.taken,
                 rounds * prompts)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # HF counts the resumed epoch's fraction from its first batch on: add the batches before the resume.
        if self._offset is not None:
            epoch, done, steps = self._offset
            if epoch <= state.epoch < epoch + 1:  # (HF's own formula, with the batches before counted)
                state.epoch = epoch + (round((state.epoch - epoch) * steps) + done) / steps

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._offset = None


def _check(saved: dict[str, Any], here: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse a checkpoint of another dataset, order, kind options or batching."""
    if saved.get("batching") != here["batching"]:
        raise ConfigError(f"cannot resume: the checkpoint was trained in other batches "
                          f"({differences(saved.get('batching') or {}, here['batching'])}); the same global "
                          "batch resumes on any number of processes")
    check_identity(saved, {k: v for k, v in here.items() if k != "batching"}, defaults)
