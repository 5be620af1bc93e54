"""Value checks shared by the configuration dataclasses and the sample checks."""

from __future__ import annotations

from typing import Any

__all__ = ["is_int_at_least"]


def is_int_at_least(value: Any, low: int) -> bool:
    """`value` is an int, not a bool (which Python counts as one), and `value >= low`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
