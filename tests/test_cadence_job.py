"""FT_SAVE_STEPS=auto in the real job: on a volume faked slow it saves less often than on a fast one, no save ever waits
for the one before, and neither the cadence nor a stop and resume changes what is trained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import NO_EVALUATION, job_env, max_weight_difference, run_job, start_job, with_faults

pytestmark = pytest.mark.slow  # each test trains the demo job in a subprocess

# Evaluation (so a save can come) every 2 steps, cheaply; FT_SAVE_EVERY_MINUTES=0.02 (1.2 s) bounds the work lost, so on the
# fast volume saves come every second or so, and on the slow one only as often as its writes allow.
AUTO = dict(FT_PRESET="demo", FT_MAX_STEPS="40", FT_BATCH_SIZE="4", FT_GRADIENT_ACCUMULATION_STEPS="2", FT_SAVE_STEPS="auto", FT_EVAL_STEPS="2",
            FT_SAVE_EVERY_MINUTES="0.02", FT_EVAL_MAX_SAMPLES="16", FT_REGISTERED_MODEL="",
            FT_SYSTEM_METRICS="false", **NO_EVALUATION)
PACE = {"seconds_per_step": "0.5"}  # 20 s of steps at least: a slow write (5-7 s with its spare) fits between the first
# save that auto allows and the last step, whatever the machine's load (at 0.25 s a step, a fast machine left no room)
SLOW_WRITE_S = 4  # each background write sleeps this long first; the probe at start is faked to predict about as long


def committed(log: str) -> list[int]:
    return [int(step) for step in re.findall(r"^fulltune: committed checkpoint at step (\d+):", log, re.MULTILINE)]


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> tuple[Path, str]:
    """The auto job on the test machine's own disk, stopped by SIGTERM at step 21 and run again to the end: (volume, both logs)."""
    folder = tmp_path_factory.mktemp("fast")
    out, log = folder / "volume", folder / "1.log"
    env = job_env(out, **AUTO)
    job = start_job(with_faults(env, sigterm_at_step=21, **PACE), log)
    assert job.wait(timeout=300) == 75, log.read_text()
    first = log.read_text()
    assert committed(first)[-1] == 21, first
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming from {out}/checkpoints/checkpoint-21" in result.stdout
    return out, first + result.stdout


@pytest.mark.faults("FT_SAVE_STEPS=auto on a volume whose every checkpoint write is slow")
def test_auto_saves_less_often_on_a_slow_volume_and_no_save_waits_for_the_one_before(fast, tmp_path):
    out, marker = tmp_path / "volume", tmp_path / "writing"
    # 5.4 MB at 1 MB/s: the probe predicts ~5 s, about what each write then takes
    env = with_faults(job_env(out, **AUTO), write_speed=1_000_000, slow_checkpoint_write=f"*:{SLOW_WRITE_S}:{marker}", **PACE)
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    slow, quick = committed(result.stdout), [step for step in committed(fast[1]) if step != 21]  # 21: the stop's save
    assert slow[-1] == 40 and all(step % 2 == 0 for step in slow[:-1]), slow  # at evaluation steps, and the last step
    assert len(slow) < len(quick), (slow, quick)
    waited = [float(value) for value in re.findall(r"checkpoint_waited_s=(\S+)", result.stdout)]
    assert waited and set(waited) == {0.0}, result.stdout  # the job's own measure: no save ever waited for the previous write
    interval = re.search(r"FT_SAVE_STEPS=auto saves at the first evaluation step (\d+) s after the last save", result.stdout)
    assert interval and int(interval.group(1)) >= SLOW_WRITE_S * 1.25, result.stdout  # the write time decides, not the 1.2 s bound
    fast_interval = re.search(r"FT_SAVE_STEPS=auto saves at the first evaluation step (\d+) s after the last save", fast[1])
    assert fast_interval and int(fast_interval.group(1)) < int(interval.group(1)), fast[1]
    # What was trained does not depend on when it was saved, nor on a stop and resume in between
    assert max_weight_difference(fast[0] / "final/model/model.safetensors", out / "final/model/model.safetensors") <= 1e-5
