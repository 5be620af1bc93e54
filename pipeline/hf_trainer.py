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
from pipeline.state import check_identity

__all__ = ["StreamResume"]

log = logging.getLogger(__name__)
KEY = "shardstream"  # its entry in the checkpoint's TrainerState.stateful_callbacks


class StreamResume(TrainerCallback):
    """Positions `dataset` (a `trainer_dataset`) from the trainer's state when training begins."""

    def __init__(self, dataset: Any) -> None:
        if not callable(getattr(dataset, "state_dict", None)) or not hasattr(dataset, "identity"):
            raise ConfigError(f"resume_callback takes the dataset of trainer_dataset or make_stream_dataset, got "
                              f"{type(dataset).__name__}")
        self.dataset = dataset
        self._offset: tuple[int, int, int] | None = None  # (epoch, micro-batches before the resume, in the epoch)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        args.ignore_data_skip = True  # the dataset starts where the checkpoint left off: nothing to skip

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        ds, accumulate = self.dataset, args.gradient_accumulation_steps
        steps = len(train_dataloader)  # HF's micro-batches per epoch: one global batch of the dataset each
        batches = rank_batch_count(ds.total, ds.world_size, ds.rank, ds.config.batch_size, ds.config.drop_last)
        if steps != batches:
            raise ConfigError(f"the trainer takes {steps} batches an epoch, the dataset has {batches} global "
                              "batches: make it with trainer_dataset(..., batch_size=args.per_device_train_batch_size, "
                              "world_size=args.world_size)")
        here = {**ds.identity, "world_size": args.world_size, "per_device": args.per_device_train_batch_size}
        saved = state.stateful_callbacks.get(KEY)
        state.stateful_callbacks[KEY] = here  # (what every checkpoint of this run is of)
        if state.global_step == 0:
            return
        if saved is None:
            log.warning("the checkpoint has no record of its dataset (it was saved without resume_callback): "
                        "resuming at global step %d of this dataset, unchecked", state.global_step)
        else:
            _check(saved, here)
        per_epoch = max(steps // accumulate + int(steps % accumulate > 0), 1)  # (HF's reckoning of epochs)
        epoch, done = divmod(state.global_step, per_epoch)
        done *= accumulate
        if done and steps % accumulate:
            raise ConfigError(f"cannot resume mid-epoch exactly: gradient_accumulation_steps={accumulate} does not divide "
                              f"the epoch's {steps} batches, and HF Trainer, told not to skip, would not step on "
                              "the epoch's last partial accumulation; resume from an epoch's end, or without "
                              "resume_callback (HF then skips the trained batches by decoding them again)")
        ds.state.set(epoch, (Resume(ds.world_size, done),) if done else ())
        self._offset = (epoch, done, steps) if done else None
        log.info("resuming at epoch %d after %d of its %d batches (global step %d)", epoch, done, steps,
                 state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # HF counts the resumed epoch's fraction from its first batch on: add the batches before the resume.
        if self._offset is not None:
            epoch, done, steps = self._offset
            if epoch <= state.epoch < epoch + 1:  # (HF's own formula, with the batches before counted)
                state.epoch = epoch + (round((state.epoch - epoch) * steps) + done) / steps

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._offset = None


def _check(saved: dict[str, Any], here: dict[str, Any]) -> None:
    """Refuse a checkpoint of another dataset, order, kind options or global batch."""
    before = saved.get("world_size", 0) * saved.get("per_device", 0)
    now = here["world_size"] * here["per_device"]
    if before != now:
        raise ConfigError(f"cannot resume: the checkpoint's global batch is {before} ({saved.get('world_size')} "
                          f"processes x {saved.get('per_device')}), this run's is {now} ({here['world_size']} x "
                          f"{here['per_device']}): the same global batch resumes in any number of processes")
    check_identity(saved, {k: v for k, v in here.items() if k not in ("world_size", "per_device")})
