"""FT_SAVE_STEPS=auto (trainer/checkpointing/cadence.py): the interval rule, the decision at evaluation steps, what the
log says a fixed cadence costs, and how the setting parses; the job itself on a volume faked slow is in
tests/test_cadence_job.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from trainer.checkpointing import cadence, commits, saving
from trainer.core import config as job_config
from trainer.core import settings
from trainer.core.errors import ConfigError
from trainer.model import recipe

GB = 1e9
REFERENCE_STATE = 12 * 4_022_468_096  # Qwen3-4B, fp32 weights + AdamW states: the 48.3 GB of docs/checkpoints.md


def test_the_interval_keeps_saves_below_five_percent_of_the_wall_time_and_never_shorter_than_a_write():
    assert cadence.interval(write_s=10.0, blocked_s=0.1) == pytest.approx(12.5)  # the write decides: no save waits for the last
    assert cadence.interval(write_s=1.0, blocked_s=1.0) == pytest.approx(20.0)  # the blocked time decides: 1 s in 20 s is 5 %
    assert 1.0 / (cadence.interval(1.0, 1.0) + 1.0) < cadence.BLOCKED_SHARE


def test_save_every_minutes_bounds_the_work_lost_but_never_makes_a_save_wait_for_the_one_before():
    assert cadence.interval(write_s=1.0, blocked_s=1.0, bound_s=5.0) == pytest.approx(5.0)  # past 5 %: the lost work matters more
    assert cadence.interval(write_s=10.0, blocked_s=1.0, bound_s=5.0) == pytest.approx(12.5)  # a save every 5 s would queue
    assert cadence.interval(write_s=1.0, blocked_s=0.1, bound_s=600.0) == pytest.approx(2.0)  # cheap saves come sooner than the bound


def test_an_interval_in_steps_is_a_multiple_of_the_evaluation_steps_rounded_up():
    assert cadence.in_steps(100.0, step_s=0.7, eval_steps=25) == 150  # 143 steps, up to the next evaluation step
    assert cadence.in_steps(1.0, step_s=0.7, eval_steps=25) == 25  # never less than one evaluation interval
    assert cadence.in_steps(10.0, step_s=0.0, eval_steps=5) == 5


def test_the_reference_job_at_the_seeds_cadence_queues_saves_and_auto_saves_every_few_hundred_steps():
    """docs/checkpoints.md's numbers: 48.3 GB at 200 MB/s is a 241 s write; a step is ~0.7 s on an H100 (8 Capybara
    sequences of ~1.1k tokens at ~12.5k tokens/s), so FT_SAVE_STEPS=25 is ~18 s of training between saves; the snapshot
    is taken as 2.4 s (48.3 GB over PCIe at ~20 GB/s into pinned buffers: an assumption, not measured here)."""
    write, step, blocked = REFERENCE_STATE / (0.2 * GB), 0.7, 2.4
    assert write == pytest.approx(241.3, abs=0.1)
    share, waits = cadence.fixed_cost(write, blocked, every_s=25 * step)
    assert waits == pytest.approx(223.8, abs=0.1) and share == pytest.approx(0.928, abs=0.001)  # each save waits for the last
    assert cadence.interval(write, blocked) == pytest.approx(301.6, abs=0.1)
    assert cadence.in_steps(cadence.interval(write, blocked), step, 25) == 450
    assert cadence.in_steps(cadence.interval(REFERENCE_STATE / GB, blocked), step, 25) == 100  # at 1 GB/s
    assert cadence.in_steps(cadence.interval(REFERENCE_STATE / (4 * GB), blocked), step, 25) == 75  # NVMe: the 5 % rule decides


def fake_saver(auto: bool = True, every_minutes: float = 0.0, write: float | None = None, blocked: float | None = None) -> commits.CommitCheckpoints:
    saver = commits.CommitCheckpoints(keep=2, every_minutes=every_minutes, auto=auto)
    if write is not None:
        saver.costs.background.append(write)
    if blocked is not None:
        saver.costs.blocked.append(blocked)
        saver.costs.own.append(blocked)
    return saver


def decides(saver: commits.CommitCheckpoints, step: int, since_last_save: float, max_steps: int = 1000, began: float = 100.0,
            save_steps: int = 10**6) -> bool:
    """What the saver decides at the end of `step` (evaluation every 5 steps), `since_last_save` s after the last save,
    `began` s after training began; `save_steps`: the Trainer's (with auto, past the last step)."""
    saver.cadence.first_step, saver.cadence.began = 0, time.monotonic() - began
    saver.cadence.last_save = time.monotonic() - since_last_save
    control = SimpleNamespace(should_save=False)
    saver.on_step_end(SimpleNamespace(eval_steps=5, save_steps=save_steps), SimpleNamespace(global_step=step, max_steps=max_steps), control)
    return control.should_save


def test_auto_saves_at_the_first_evaluation_step_once_the_interval_has_passed():
    saver = fake_saver(write=8.0, blocked=0.2)  # 10 s from one save to the next
    assert not decides(saver, 10, since_last_save=9.0)
    assert not decides(saver, 11, since_last_save=11.0)  # not an evaluation step
    assert decides(saver, 15, since_last_save=11.0)


def test_auto_never_starts_a_save_while_the_last_one_is_still_being_written(monkeypatch):
    saver = fake_saver(write=8.0, blocked=0.2)
    monkeypatch.setattr(saving.Saves, "in_flight", property(lambda self: True))  # the volume is slower now than it was measured
    assert not decides(saver, 15, since_last_save=60.0)


def test_auto_leaves_out_a_save_whose_write_would_still_run_when_the_last_step_saves():
    saver = fake_saver(write=8.0, blocked=0.2)
    # 100 s for 100 steps: 1 s a step; 5 steps left is 5 s, less than the 10 s a write needs with its spare
    assert not decides(saver, 100, since_last_save=60.0, max_steps=105, began=100.0)
    assert decides(saver, 100, since_last_save=60.0, max_steps=120, began=100.0)


def test_the_steps_slowed_beside_a_write_count_in_what_a_save_costs_and_stretch_autos_interval():
    """On CPU most of a save's cost is paid by the steps that run beside its write (checkpointing/costs.py), not in
    the time it blocked: auto's 5 % rule goes by both."""
    saver = fake_saver(write=1.0, blocked=0.2)
    assert saver.cadence.seconds() == pytest.approx(4.0)  # 20 x 0.2 s blocked
    for seconds, overlapped in [(1.0, False), (1.0, False), (1.0, False), (1.6, True), (1.4, True)]:
        saver.costs.step(seconds, overlapped)  # one save's write slowed two steps by 0.6 and 0.4 s
    assert saver.cadence.measured()[1] == pytest.approx(1.2)
    assert saver.cadence.seconds() == pytest.approx(24.0)  # 20 x (0.2 s blocked + 1.0 s slowed)
    assert not decides(saver, 15, since_last_save=20.0) and decides(saver, 15, since_last_save=25.0)


def test_before_the_first_write_is_measured_auto_goes_by_the_probes_estimate():
    saver = fake_saver()
    saver.cadence.expected_write = 40.0  # state size / the volume's speed measured at start
    assert saver.cadence.seconds() == pytest.approx(50.0)
    assert not decides(saver, 15, since_last_save=45.0) and decides(saver, 20, since_last_save=55.0)
    unknown = fake_saver()  # nothing measured, no estimate: the first evaluation step saves, and measures
    assert decides(unknown, 5, since_last_save=0.5)


def test_a_fixed_cadence_keeps_save_every_minutes_as_it_was():
    saver = fake_saver(auto=False, every_minutes=1 / 60, write=100.0, blocked=5.0)  # costs play no part
    assert not decides(saver, 5, since_last_save=0.5) and decides(saver, 10, since_last_save=2.0)
    assert not decides(fake_saver(auto=False), 10, since_last_save=3600.0)


def test_the_log_says_once_what_a_fixed_cadence_costs_and_what_auto_would_do(capsys):
    saver = fake_saver(auto=False, write=30.0, blocked=0.5)
    decides(saver, 20, since_last_save=5.0, began=20.0, save_steps=10)  # 1 s a step: a save every 10 steps is 10 s of training
    line = capsys.readouterr().out
    assert line.startswith("fulltune: checkpoint cost: a save cost training 0.50 s and writes for 30.0 s in the background (measured);")
    assert "at FT_SAVE_STEPS=10 (~10 s of training at 1.00 s a step) saves take 67.2% of the wall time" in line
    assert "and queue behind each other (each waits ~20 s for the one before)" in line
    assert line.rstrip().endswith("FT_SAVE_STEPS=auto would save every 40 steps")  # 37.5 s at 1 s a step, up to a multiple of 5
    decides(saver, 25, since_last_save=5.0, began=25.0, save_steps=10)
    assert capsys.readouterr().out == ""  # once
    decides(fake_saver(auto=False), 20, since_last_save=5.0)  # no save yet: nothing to say
    assert capsys.readouterr().out == ""
    unknown = fake_saver(auto=False, blocked=0.5)  # saved, still writing, and the volume's speed was not measured: wait for the write
    decides(unknown, 20, since_last_save=5.0, save_steps=10)
    assert capsys.readouterr().out == ""


def test_while_the_first_write_still_runs_the_line_goes_by_the_probes_prediction(capsys):
    """The reference job at 200 MB/s: its first write outlasts the rest of training, so the line cannot wait for it."""
    saver = fake_saver(auto=False, blocked=2.4)
    saver.cadence.expected_write = 241.3
    decides(saver, 26, since_last_save=0.7, began=26 * 0.7, save_steps=25)
    line = capsys.readouterr().out
    assert "writes for 241.3 s in the background (as the volume's speed at start predicts); at FT_SAVE_STEPS=25 (~18 s of training" in line
    assert "saves take 92.8% of the wall time and queue behind each other (each waits ~224 s for the one before)" in line
    assert line.rstrip().endswith("FT_SAVE_STEPS=auto would save every 435 steps")  # 302 s at 0.7 s a step: 431, up to a multiple of 5


def test_with_auto_the_log_says_how_often_it_saves(capsys):
    decides(fake_saver(write=8.0, blocked=0.2), 20, since_last_save=1.0, began=20.0)
    assert capsys.readouterr().out.rstrip().endswith(
        "FT_SAVE_STEPS=auto saves at the first evaluation step 10 s after the last save, about every 10 steps at 1.00 s a step")


def test_auto_parses_and_is_exempt_from_the_multiple_of_eval_steps_rule():
    loaded = settings.load({"FT_PLATFORM": "none", "FT_SAVE_STEPS": "auto", "FT_EVAL_STEPS": "7"})
    assert loaded.save_steps == "auto"
    with pytest.raises(ConfigError, match=r"FT_SAVE_STEPS='Auto': Not a valid integer \(allowed: an integer >= 1 and <= 2147483647 or auto\)"):
        settings.load({"FT_PLATFORM": "none", "FT_SAVE_STEPS": "Auto"})
    assert settings.BY_ENV_NAME["FT_SAVE_STEPS"].type_name == "int \\| `auto`"


def test_with_auto_the_trainers_own_saves_come_only_at_the_last_step():
    loaded = settings.load({"FT_PLATFORM": "none", "FT_SAVE_STEPS": "auto", "FT_EVAL_STEPS": "7", "FT_MAX_STEPS": "50"})
    assert recipe.save_steps(loaded, 50) == 56  # a multiple of FT_EVAL_STEPS (load_best_model_at_end), past step 50
    assert recipe.save_steps(settings.load({"FT_PLATFORM": "none"}), 50) == 25


def test_auto_and_a_fixed_cadence_are_the_same_computation_to_the_fingerprint():
    """A resume is exact whatever cadence wrote the checkpoint: switching to or from auto never refuses the volume."""
    def fingerprint(save_steps: str) -> dict[str, str]:
        loaded = settings.load({"FT_PLATFORM": "none", "FT_SAVE_STEPS": save_steps})
        return job_config.build(loaded, cuda=False, bf16_supported=False).fingerprint()

    assert fingerprint("auto") == fingerprint("25") == fingerprint("50")
