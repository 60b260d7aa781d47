"""Whether the process that wrote the lease or its lock (trainer/launch/lease.py) is provably gone: only a holder
that ran in this pid namespace of this boot of this machine can be checked, by its pid; any other is judged by
watching what it wrote stay unchanged.  Apart from lease.py because both taking over a lease and breaking its lock
ask it.
"""

from __future__ import annotations

import os
from typing import Any


def this_pid_namespace() -> dict[str, str]:
    """What identifies the pid namespace of this boot of this machine: only there is a lease holder's pid checkable.
    Empty where /proc does not say (not Linux): leases are then taken over by watching only."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return {"boot_id": boot, "pid_namespace": os.readlink("/proc/self/ns/pid")}
    except OSError:
        return {}


def gone_from_this_machine(holder: dict[str, Any]) -> bool:
    """The holder ran in this pid namespace of this boot and its pid no longer exists (or is now ours)."""
    place = this_pid_namespace()
    if not place or any(holder.get(key) != value for key, value in place.items()):
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    return False
