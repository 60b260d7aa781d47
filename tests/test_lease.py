"""Two jobs, one volume: a second job started where another runs exits 7 naming it, and the first goes on unharmed;
a lease left by a job that is gone is taken over; the job releases its lease however it ends.

Real entrypoint.py processes on one volume folder, real signals, the lease file as the jobs leave it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from conftest import NO_EVALUATION, ROOT, committed_steps, job_env, run_job, start_job, termination_message, wait_for, with_faults

pytestmark = pytest.mark.slow  # every test starts the job in subprocesses

LEASE = Path(".fulltune") / "lease.json"
DEMO = dict(FT_PRESET="demo", FT_MAX_STEPS="20", FT_SAVE_STEPS="10", FT_EVAL_STEPS="10", FT_BATCH_SIZE="4",
            FT_GRADIENT_ACCUMULATION_STEPS="2", **NO_EVALUATION)  # 8 sequences a step, not the preset's 64: the lease, not the learning


def holder_named(lease: dict) -> str:
    return f"host {lease['host']}, pid {lease['pid']}, started {lease['started_at']}"


def start_in_own_group(env: dict[str, str], log: Path) -> subprocess.Popen:
    """A job whose whole process tree can be SIGKILLed at once, as when its machine or container is lost."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=ROOT, start_new_session=True, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


@pytest.mark.faults("a second job on a running job's volume")
def test_a_second_job_on_a_running_jobs_volume_exits_7_naming_it_and_the_first_finishes_unharmed(tmp_path):
    out, log = tmp_path / "volume", tmp_path / "first.log"
    env = job_env(out, **DEMO, FT_LEASE_SECONDS="12")
    first = start_job(with_faults(env, seconds_per_step="0.5"), log)  # 10 s of training at least: the second job needs ~3
    try:
        wait_for(lambda: "starting from step 0" in log.read_text(), timeout=300, what="the first job to train")
        lease = json.loads((out / LEASE).read_text())
        assert (lease["host"], lease["pid"]) == (socket.gethostname(), first.pid)  # held by the first job's entrypoint.py

        second_env = env | {"FT_TERMINATION_MESSAGE_PATH": str(tmp_path / "second.termination-log")}
        started = time.monotonic()
        second = run_job(second_env, timeout=120)
        took = time.monotonic() - started
        print(f"the second job exited {second.returncode} after {took:.1f} s (FT_LEASE_SECONDS=12: refreshed every 4 s)")
        assert second.returncode == 7, second.stdout + second.stderr
        assert "Traceback" not in second.stderr
        assert f"exit 7: FT_OUTPUT_DIR={out} is in use by another job: {holder_named(lease)}" in second.stderr
        assert "wait for that job to end, stop it, or give this job another FT_OUTPUT_DIR" in second.stderr
        assert holder_named(lease) in termination_message(second_env)
        assert took < 12, "the second job waited for the lease to go stale instead of seeing it refreshed"
        assert json.loads((out / LEASE).read_text())["attempt"] == lease["attempt"], "the second job left the first one's lease alone"
        assert first.poll() is None, "the first job still runs"
    finally:
        code = first.wait(timeout=300)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "step=20/20" in text and committed_steps(out) == [10, 20]
    assert (out / "final" / "model" / "model.safetensors").exists()
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert [r.info.status for r in runs] == ["FINISHED"], "one run, the first job's: the second started none"
    assert not (out / LEASE).exists(), "released at exit 0: the next job starts at once"


@pytest.mark.faults("three jobs started together on one volume", "a running job whose lease another job took over")
def test_of_jobs_started_together_one_runs_the_others_exit_7_and_a_job_whose_lease_is_taken_over_stops(tmp_path):
    out = tmp_path / "volume"
    held = [tmp_path / f"training-process-{i}" for i in range(3)]
    envs = [with_faults(job_env(out, **DEMO, FT_LEASE_SECONDS="3"), hold_start=held[i]) for i in range(3)]  # a training process that waits
    for i, env in enumerate(envs):
        env["FT_TERMINATION_MESSAGE_PATH"] = str(tmp_path / f"{i}.termination-log")
    jobs = [start_job(env, tmp_path / f"{i}.log") for i, env in enumerate(envs)]
    try:
        wait_for(lambda: sum(job.poll() is not None for job in jobs) == 2, timeout=120, what="two of the three jobs to end")
        (winner,) = [i for i, job in enumerate(jobs) if job.poll() is None]
        wait_for(held[winner].exists, timeout=120, what="the winner's training process")
        lease = json.loads((out / LEASE).read_text())
        assert lease["pid"] == jobs[winner].pid
        for i, job in enumerate(jobs):
            if i != winner:
                assert job.returncode == 7, (tmp_path / f"{i}.log").read_text()
                assert f"in use by another job: {holder_named(lease)}" in termination_message(envs[i])
        assert [path.exists() for path in held].count(True) == 1
        assert sorted(p.name for p in out.iterdir()) == [".fulltune"] and sorted(p.name for p in (out / ".fulltune").iterdir()) == ["lease.json"]

        # A job that went FT_LEASE_SECONDS without refreshing (a stalled volume) finds its lease taken over by another job:
        # it ends its training process without saving and exits 7, and leaves the other job's lease in place.
        other = lease | {"host": "other-node", "pid": 4242, "attempt": "taken-over", "started_at": "2030-01-01T00:00:00+00:00"}
        (out / "lease.tmp").write_text(json.dumps(other))
        os.replace(out / "lease.tmp", out / LEASE)
        training_process = int(held[winner].read_text())
        started = time.monotonic()
        assert jobs[winner].wait(timeout=30) == 7, (tmp_path / f"{winner}.log").read_text()
        print(f"the job whose lease was taken over exited 7 after {time.monotonic() - started:.1f} s (FT_LEASE_SECONDS=3)")
        # Found at its next refresh (every FT_LEASE_SECONDS / 3 = 1 s), then the training process is ended without a save;
        # the bound allows a loaded machine 10 s for that end, and still fails a job that waits out its training.
        assert time.monotonic() - started < 3 / 3 + 10
        message = termination_message(envs[winner])
        assert "taken over by another job (host other-node, pid 4242, started 2030-01-01T00:00:00+00:00" in message and "stopped without saving" in message
        with pytest.raises(ProcessLookupError):
            os.kill(training_process, 0)
        assert json.loads((out / LEASE).read_text())["attempt"] == "taken-over"
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()


@pytest.mark.faults("a lease left by a job killed on another machine", "a lease left by a job killed on this machine")
def test_a_lease_left_by_a_killed_job_is_taken_over_and_each_restart_resumes(tmp_path):
    out = tmp_path / "volume"
    env = job_env(out, **(DEMO | {"FT_MAX_STEPS": "30"}), FT_LEASE_SECONDS="4")
    slow = with_faults(env, seconds_per_step="0.3")

    # 1. The whole job is SIGKILLed (its container or machine is lost): the lease stays behind.
    job = start_in_own_group(slow, tmp_path / "1.log")
    wait_for(lambda: committed_steps(out) == [10], timeout=300, what="checkpoint 10")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    left = json.loads((out / LEASE).read_text())
    assert left["pid"] == job.pid

    # 2. As if it had run on another machine: the restart cannot see its process, watches the lease for FT_LEASE_SECONDS,
    #    sees no refresh, takes it over and resumes.
    (out / "lease.tmp").write_text(json.dumps(left | {"host": "lost-node", "boot_id": "another-boot"}))
    os.replace(out / "lease.tmp", out / LEASE)
    log2 = tmp_path / "2.log"
    job = start_in_own_group(slow, log2)
    wait_for(lambda: committed_steps(out) == [10, 20], timeout=300, what="checkpoint 20")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    text = log2.read_text()
    assert f"is leased by host lost-node, pid {left['pid']}, started {left['started_at']}" in text and "watching it for up to 4 s" in text
    assert "was not refreshed for 4 s, so its job is gone" in text and "taking it over" in text
    assert f"resuming from {out}/checkpoints/checkpoint-10" in text

    # 3. Killed on this machine: its pid is gone, so the restart takes the lease over at once, resumes and finishes.
    restarted = run_job(env)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert "took over the lease" in restarted.stdout and "whose process is gone" in restarted.stdout and "watching" not in restarted.stdout
    assert f"resuming from {out}/checkpoints/checkpoint-20" in restarted.stdout
    assert committed_steps(out) == [20, 30] and (out / "final" / "model" / "model.safetensors").exists()
    assert not (out / LEASE).exists()


def test_a_job_that_exits_2_after_taking_the_lease_releases_it(tmp_path):
    out = tmp_path / "volume"
    result = run_job(job_env(out, FT_PRESET="demo", FT_LIGER="true"), timeout=120)  # refused once the device is known, with the lease held
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FT_LIGER=true needs a GPU" in result.stderr
    assert not out.exists() or not any(out.iterdir()), "nothing is left on the volume: no lease, no empty state folder"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            found += map(int, children)
            queue += map(int, children)
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.faults("entrypoint.py killed alone, its training process left behind")
def test_a_training_process_whose_launcher_is_killed_stops_and_the_next_start_takes_the_lease_at_once(tmp_path):
    out, log = tmp_path / "volume", tmp_path / "first.log"
    env = job_env(out, **DEMO)
    first = start_job(with_faults(env, seconds_per_step=0.5), log)
    wait_for(lambda: "starting from step 0" in log.read_text(), what="training to start")
    below = descendants(first.pid)
    assert below, "the training process runs below entrypoint.py"
    first.kill()  # entrypoint.py alone, as `kill -9 <pid>` outside a container; its children stay
    first.wait()
    started = time.monotonic()
    wait_for(lambda: not any(map(running, below)), timeout=15, what="the training process to end with its launcher")
    print(f"training process gone {time.monotonic() - started:.1f} s after its launcher")
    assert "the launcher (entrypoint.py" in log.read_text()
    again = run_job(env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "took over the lease" in again.stdout and "watching it" not in again.stdout
