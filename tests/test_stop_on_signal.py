"""The stop deadline is disarmed by the stop's own checkpoint only, whatever save was under way when the signal came."""

from __future__ import annotations

import os
import signal

import pytest
from transformers import TrainerControl, TrainerState

from trainer.checkpointing.preemption import StopOnSignal


@pytest.fixture
def stopper():
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    stop = StopOnSignal(deadline_seconds=3600)  # never reached here: it would end this process with exit 76
    yield stop
    if stop.deadline is not None:
        stop.deadline.cancel()
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def at_step(step: int) -> TrainerState:
    state = TrainerState()
    state.global_step = step
    return state


@pytest.mark.faults("SIGTERM between a periodic save and its on_save")
def test_a_signal_during_a_periodic_save_keeps_the_deadline_until_the_stops_own_checkpoint(stopper):
    os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 10's checkpoint is being written in the background
    assert stopper.requested and stopper.deadline.is_alive()
    stopper.on_save(None, at_step(10), TrainerControl())  # step 10's periodic save reaches the callbacks
    assert not stopper.committed and stopper.deadline.is_alive(), "a periodic save is not the stop's checkpoint"

    control = stopper.on_step_end(None, at_step(11), TrainerControl())  # the stop is acted on at the next step end
    assert control.should_save and control.should_training_stop and not control.should_evaluate
    stopper.on_save(None, at_step(11), control)  # the stop's own checkpoint, committed
    assert stopper.committed
    stopper.deadline.join(timeout=5)
    assert not stopper.deadline.is_alive()
