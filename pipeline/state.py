"""Where a loader stands: the epoch and its resumption history, shared with the DataLoader workers,
and what a saved state (`StreamLoader.state_dict`, `ShardStream.state_dict`) must share with the
loader that resumes it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipeline.checks import is_int_at_least
from pipeline.errors import ConfigError
from pipeline.format import Manifest
from pipeline.plan import Resume

__all__ = ["EpochState", "STATE_VERSION", "ORDER_SETTINGS", "fingerprint", "describe", "option_defaults", "differences",
           "check_identity", "resume_point"]

# 3: the mixed order is windowed (a state of an earlier mixed epoch would not resume exactly);
# 4: the kind's options are part of what a state must share
STATE_VERSION = 4
MAX_STRETCHES = 16  # resumptions within one epoch
# Settings a saved state must share with the loader that resumes it: they decide the samples' order.
ORDER_SETTINGS = ("seed", "batch_size", "drop_last", "shuffle", "shuffle_window")


class EpochState:
    """The epoch the next iteration plays and its resumption history (`Resume` stretches), in shared
    memory: set by the main process, read by the workers (forked or spawned)."""

    def __init__(self) -> None:
        # The epoch, the number of stretches, then world_size and batches of each stretch.
        self.shared = torch.zeros(2 + 2 * MAX_STRETCHES, dtype=torch.int64).share_memory_()
        # Whether the epoch was chosen (`set_epoch`, `set`) rather than left at its initial 0: a
        # worker's own saved position (`ShardStream.load_state_dict`) gives way only to a chosen one.
        self.chosen = torch.zeros(1, dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self.shared[0])

    @property
    def history(self) -> tuple[Resume, ...]:
        pairs = self.shared[2 : 2 + 2 * int(self.shared[1])].tolist()
        return tuple(Resume(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))

    def set(self, epoch: int, history: Sequence[Resume] = ()) -> None:
        if len(history) > MAX_STRETCHES:
            raise ConfigError(f"an epoch can be resumed at most {MAX_STRETCHES} times")
        values = [epoch, len(history)] + [v for h in history for v in (h.world_size, h.batches)]
        self.shared.zero_()
        self.shared[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.chosen[0] = 1

    def set_epoch(self, epoch: int) -> bool:
        """Play `epoch` from its beginning next, unless it is the current one (which keeps a
        resumption point); whether it changed."""
        if not is_int_at_least(epoch, 0):
            raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")
        if epoch == self.epoch:
            self.chosen[0] = 1
            return False
        self.set(epoch, ())
        return True


def fingerprint(manifests: Sequence[Manifest], mix_counts: Sequence[int] | None) -> str:
    """The datasets a state is of and, when mixing, each one's share."""
    if len(manifests) == 1:
        return manifests[0].fingerprint
    return hashlib.sha256(json.dumps([[m.fingerprint for m in manifests], mix_counts]).encode()).hexdigest()


def describe(value: Any) -> Any:
    """`value` (a kind's options) as plain JSON data, to compare with a saved state's: a function by
    its qualified name, a dataclass by its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)


def differences(there: Mapping[str, Any], here: Mapping[str, Any]) -> str:
    """The entries two dicts disagree on, for a message: "name: there's value there, here's here; ...";
    an entry one lacks is "absent" there (an option added since a state was saved, say)."""
    def shown(entries: Mapping[str, Any], name: str) -> str:
        return repr(entries[name]) if name in entries else "absent"

    names = sorted(k for k in there.keys() | here.keys() if (k in there, there.get(k)) != (k in here, here.get(k)))
    return "; ".join(f"{k}: {shown(there, k)} there, {shown(here, k)} here" for k in names)


def option_defaults(options: Any) -> dict[str, Any]:
    """A kind's options' defaults (its dataclass's), described as `describe` describes values: what an
    option absent from a saved state meant (it did not exist yet, and its default keeps the batches
    as they were without it)."""
    if not dataclasses.is_dataclass(options):
        return {}
    found = {}
    for field in dataclasses.fields(options):
        if field.default is not dataclasses.MISSING:
            found[field.name] = describe(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            found[field.name] = describe(field.default_factory())
    return found


def check_identity(state: Any, identity: dict[str, Any], defaults: Mapping[str, Any] | None = None) -> None:
    """Refuse a saved state of another dataset, split, order or kind options than `identity` says. A
    kind option the state lacks (saved before the option existed) is taken at its default (`defaults`)."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"cannot resume: a state is a dict, got {type(state).__name__}")
    for name, value in identity.items():
        saved = state.get(name)
        if name == "options" and isinstance(value, dict) and isinstance(saved, dict):
            saved = {**{k: v for k, v in (defaults or {}).items() if k in value}, **saved}
            if saved != value:
                raise ConfigError("cannot resume: the state was saved with other options of the kind "
                                  f"({differences(saved, value)})")
        elif saved != value:
            raise ConfigError(f"cannot resume: the state's {name} is {saved!r}, this loader's is {value!r}")


def resume_point(state: dict[str, Any], identity: dict[str, Any],
                 defaults: Mapping[str, Any] | None = None) -> tuple[int, tuple[Resume, ...]]:
    """(epoch, history) of a saved state, refused when it is of another dataset, split, order or kind
    options than `identity` says (options it lacks taken at their `defaults`), or malformed."""
    check_identity(state, identity, defaults)
    try:
        history = tuple(Resume(int(w), int(b)) for w, b in state["history"])
        epoch = int(state["epoch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"cannot resume: malformed state ({exc})") from exc
    return epoch, history
