"""lease.lock (trainer/launch/lease.py) is broken only when its holder is provably gone, never for its age alone."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from trainer.core.volume import Volume
from trainer.launch.lease import Lease
from trainer.launch.pid_namespace import this_pid_namespace


def _acquire_in_background(lease: Lease) -> threading.Event:
    got = threading.Event()

    def hold():
        with lease._locked():
            got.set()

    threading.Thread(target=hold, daemon=True).start()
    return got


def _left_lock(tmp_path, holder: dict) -> Volume:
    volume = Volume(str(tmp_path / "out"))
    (tmp_path / "out" / ".fulltune").mkdir(parents=True, exist_ok=True)
    with open(volume.lease_lock, "w", encoding="utf-8") as f:
        f.write(json.dumps(holder))
    return volume


def test_a_lock_held_by_a_process_on_another_machine_is_kept_for_the_whole_lease_period_then_broken(tmp_path):
    # Another machine's holder cannot be checked: on a stalled volume it may still be writing, so its lock stands
    # until it stayed the same for FT_LEASE_SECONDS (the old rule broke any lock after 10 s).
    seconds = 15
    _left_lock(tmp_path, {"pid": 4242, "attempt": "theirs", "boot_id": "another-machine", "pid_namespace": "pid:[1]"})
    lease = Lease(str(tmp_path / "out"), seconds, on_lost=lambda: None)
    started = time.monotonic()
    got = _acquire_in_background(lease)
    assert not got.wait(seconds - 3), "the lock of a holder that may be alive was broken before the lease period"
    assert got.wait(seconds + 60), "a lock unchanged for the lease period was never broken"
    assert time.monotonic() - started >= seconds


def test_a_lock_left_by_a_dead_process_on_this_machine_is_broken_at_once(tmp_path):
    place = this_pid_namespace()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _left_lock(tmp_path, {"pid": dead.pid, "attempt": "theirs", **place})
    lease = Lease(str(tmp_path / "out"), 600, on_lost=lambda: None)
    got = _acquire_in_background(lease)
    assert got.wait(5), "a lock whose holder's pid is gone was not broken"


def test_a_lock_held_by_a_live_process_on_this_machine_is_not_broken(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _left_lock(tmp_path, {"pid": alive.pid, "attempt": "theirs", **this_pid_namespace()})
        lease = Lease(str(tmp_path / "out"), 600, on_lost=lambda: None)
        got = _acquire_in_background(lease)
        assert not got.wait(12)  # longer than the old 10 s rule
    finally:
        alive.kill()
        alive.wait()
