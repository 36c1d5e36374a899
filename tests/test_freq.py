"""FreqController: steps, epochs, seconds (injected clock), combinations, state round trip."""

from __future__ import annotations

import pytest

from areal_lightning.trigger.freq import FreqController


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fired_steps(ctl: FreqController, steps: range) -> list[int]:
    out = []
    for s in steps:
        if ctl.check_step(s):
            ctl.mark_fired(s)
            out.append(s)
    return out


def test_steps_fire_on_multiples() -> None:
    assert fired_steps(FreqController(freq_steps=3), range(1, 11)) == [3, 6, 9]


def test_disabled_never_fires() -> None:
    ctl = FreqController()
    assert not ctl.enabled
    assert fired_steps(ctl, range(1, 50)) == []
    assert not ctl.check_epoch(1, 10)


def test_epochs_fire_on_multiples_of_completed_epochs() -> None:
    ctl = FreqController(freq_epochs=2)
    fired = []
    for epoch in range(1, 7):
        if ctl.check_epoch(epoch, steps_done=epoch * 10):
            ctl.mark_fired(epoch * 10)
            fired.append(epoch)
    assert fired == [2, 4, 6]


def test_seconds_trigger_uses_clock_and_resets_on_fire() -> None:
    clock = FakeClock()
    ctl = FreqController(freq_secs=10, clock=clock)
    ctl.start()
    assert not ctl.check_step(1)
    clock.now += 9.99
    assert not ctl.check_step(2)
    clock.now += 0.01
    assert ctl.check_step(3)
    ctl.mark_fired(3)
    clock.now += 5
    assert not ctl.check_step(4)
    clock.now += 5
    assert ctl.check_step(5)


def test_any_condition_fires_and_same_step_never_twice() -> None:
    clock = FakeClock()
    ctl = FreqController(freq_epochs=1, freq_steps=4, freq_secs=100, clock=clock)
    ctl.start()
    assert ctl.check_step(4)
    ctl.mark_fired(4)
    # The epoch ends at the same step: no second save for step 4.
    assert not ctl.check_epoch(1, steps_done=4)
    assert not ctl.check_step(4)
    clock.now += 100
    assert ctl.check_step(5)  # seconds
    ctl.mark_fired(5)
    assert ctl.check_epoch(2, steps_done=6)  # epoch


def test_zero_steps_never_fires() -> None:
    clock = FakeClock()
    ctl = FreqController(freq_steps=1, freq_epochs=1, freq_secs=1, clock=clock)
    clock.now += 10
    assert not ctl.check_step(0)
    assert not ctl.check_epoch(1, steps_done=0)


def test_state_round_trip_restores_progress() -> None:
    clock = FakeClock()
    ctl = FreqController(freq_steps=5, freq_secs=60, clock=clock)
    ctl.start()
    ctl.mark_fired(5)
    clock.now += 40
    state = ctl.state_dict()
    assert state["last_fired_step"] == 5 and state["secs_since_fire"] == pytest.approx(40)

    clock2 = FakeClock()
    clock2.now = 5.0  # a new process: another monotonic origin
    restored = FreqController(freq_steps=5, freq_secs=60, clock=clock2)
    restored.load_state_dict(state)
    assert restored.last_fired_step == 5
    assert not restored.check_step(5)  # already saved at step 5
    clock2.now += 19.9
    assert not restored.check_step(6)
    clock2.now += 0.1
    assert restored.check_step(6)  # 40 s before the save + 20 s after = 60 s


def test_current_config_frequencies_win_over_saved_ones() -> None:
    old = FreqController(freq_steps=5, freq_epochs=1)
    old.mark_fired(5)
    state = old.state_dict()
    assert state["freq_steps"] == 5
    new = FreqController(freq_steps=2, freq_epochs=None)
    new.load_state_dict(state)
    assert (new.freq_steps, new.freq_epochs) == (2, None)
    assert new.last_fired_step == 5
    assert fired_steps(new, range(6, 11)) == [6, 8, 10]
    assert not new.check_epoch(3, steps_done=11)
