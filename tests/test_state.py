"""pipeline.state alone: the shared epoch state and the saved-state checks."""

from __future__ import annotations

import pytest

from pipeline.plan import Resume
from pipeline.state import EpochState, fingerprint, option_defaults, resume_point


def test_epoch_and_history_round_trip():
    state = EpochState()
    assert (state.epoch, state.history) == (0, ())
    history = (Resume(4, 3), Resume(2, 7))
    state.set(5, history)
    assert (state.epoch, state.history) == (5, history)
    state.set(2)
    assert (state.epoch, state.history) == (2, ())
    with pytest.raises(ValueError, match="at most 16 times"):
        state.set(0, [Resume(1, 1)] * 17)


def test_set_epoch_keeps_a_resumption_point_of_the_same_epoch():
    state = EpochState()
    state.set(3, (Resume(2, 5),))
    assert state.set_epoch(3) is False and state.history == (Resume(2, 5),)
    assert state.set_epoch(4) is True and (state.epoch, state.history) == (4, ())
    for bad in (True, -1, 1.0):
        with pytest.raises(ValueError, match="epoch must be an int >= 0"):
            state.set_epoch(bad)


def test_resume_point_checks_identity_and_form():
    identity = {"version": 3, "split": "train", "seed": 0}
    state = {**identity, "epoch": 2, "history": [[4, 3]], "rank": 1}
    assert resume_point(state, identity) == (2, (Resume(4, 3),))
    with pytest.raises(ValueError, match="the state's seed is 1, this loader's is 0"):
        resume_point({**state, "seed": 1}, identity)
    with pytest.raises(ValueError, match="malformed state"):
        resume_point({**identity, "epoch": 2, "history": [[4]]}, identity)


def test_an_option_a_state_lacks_is_taken_at_its_default():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Options:
        size: int = 64
        flip: float = 0.0  # (added after the state below was saved)
        ranges: tuple = dataclasses.field(default_factory=lambda: (1, 2))

    assert option_defaults(Options()) == {"size": 64, "flip": 0.0, "ranges": [1, 2]}
    old = {"version": 3, "options": {"size": 64}, "epoch": 1, "history": []}
    here = {"version": 3, "options": {"size": 64, "flip": 0.0, "ranges": [1, 2]}}
    assert resume_point(old, here, option_defaults(Options())) == (1, ())
    with pytest.raises(ValueError, match=r"other options of the kind \(flip: 0.0 there, 0.5 here\)"):
        resume_point(old, {**here, "options": {**here["options"], "flip": 0.5}}, option_defaults(Options()))
    with pytest.raises(ValueError, match=r"flip: absent there, 0.0 here"):  # (no defaults known: refused)
        resume_point(old, here)


class _Manifest:
    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint


def test_fingerprint_of_one_dataset_is_its_own_and_a_mix_depends_on_shares():
    a, b = _Manifest("a" * 64), _Manifest("b" * 64)
    assert fingerprint([a], None) == "a" * 64
    assert fingerprint([a, b], [1, 2]) != fingerprint([a, b], [2, 1]) != fingerprint([b, a], [1, 2])
