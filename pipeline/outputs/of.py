"""What a sidecar's outputs are of (`outputs_of`), and the comparison that refuses a sidecar of
another dataset, split, seed or kind options (`refusal`): what a teacher pass and a student pass
must share so that each sees the identical sample. Batch size, world size, workers, shuffle and
storage never matter: a sample is a pure function of (seed, epoch, key) and the kind's options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.format import Manifest
from pipeline.state import describe, differences

__all__ = ["KEYS", "outputs_of", "refusal"]

KEYS = ("keys",)  # the inputs of outputs of the sample's key alone (a linked sidecar's): no option, no epoch


def outputs_of(manifests: Sequence[Manifest], split: str, kind: Any, items: Sequence[int], seed: int,
               inputs: Sequence[str] | None) -> dict[str, Any]:
    """The identity of outputs computed from `inputs` (batch fields; None: the whole sample) of a
    loader's samples: the seed only where those fields change with the epoch, the kind options
    that shape them only (`Kind.depends`; of `KEYS`, none: `kind` may be None)."""
    if inputs is not None and tuple(inputs) == KEYS:
        varies, shaping, options = False, frozenset(), {}
    else:
        varies, shaping = kind.depends(None if inputs is None else frozenset(inputs))
        options = describe(kind.options)
    return {"datasets": [m.fingerprint for m in manifests], "split": split, "items": [int(n) for n in items],
            "kind": manifests[0].kind, "inputs": None if inputs is None else sorted(inputs),
            "options": {name: value for name, value in options.items() if name in shaping},
            "seed": seed if varies else None, "by_epoch": varies}


def refusal(there: dict[str, Any], here: dict[str, Any]) -> str | None:
    """What differs between a sidecar's `of` and a loader's (None: they match), for a message. The
    loader's is computed with the sidecar's `inputs`."""
    if there == here:
        return None
    names = {"datasets": "datasets (their manifests' fingerprints)", "items": "samples per source"}
    parts = []
    for key in sorted(there.keys() | here.keys()):
        a, b = there.get(key), here.get(key)
        if a == b:
            continue
        if key == "options" and isinstance(a, dict) and isinstance(b, dict):
            parts.append(f"kind options ({differences(a, b)})")
        else:
            parts.append(f"{names.get(key, key)}: {a!r} there, {b!r} here")
    return "; ".join(parts)
