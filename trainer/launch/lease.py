"""One job at a time on a volume: a lease the running job keeps fresh, so that a second job started on the same
FT_OUTPUT_DIR exits 7 instead of writing into the first one's checkpoints.

    with lease.held(settings, stopping=..., on_lost=...):   # exit 7 (VolumeInUse) while another job holds it
        ...                                                 # refreshed every FT_LEASE_SECONDS / 3 meanwhile

The lease is `.fulltune/lease.json`: the holder's host name, pid, a random attempt id, when it started and when it
last refreshed the lease.  entrypoint.py of node 0 holds it: the one process that lives for the whole job (the
training process, torchrun and its workers come and go under it), that needs no torch to answer within seconds,
and that sees every way the job ends, so the lease is released on each of them (0, 1, 2, ..., 75, 76) and a
restart after a clean stop starts at once.  The other nodes take no lease: the nodes of one job share the volume.

A lease left behind (the job was SIGKILLed, its machine lost) is taken over:
  - at once when its holder ran on this machine in this pid namespace (the same boot, the same container) and
    that pid is gone: a restart in the same container or on the same host;
  - otherwise once it has not changed for FT_LEASE_SECONDS (or the holder's own, if longer): a live holder
    rewrites it every third of that, so a lease that stays the same that long belongs to a job that is gone.
    Clocks are never compared, so clock skew between machines does not matter.
A lease that changes while it is watched belongs to a running job: exit 7.

Why a lease file and not flock/fcntl: on NFS mounted without a lock manager, Cloud Storage FUSE or blobfuse those
locks are local to one machine (they succeed and protect nothing), and they cannot tell the second job who holds
the volume.  A lease file works wherever rename does, which the checkpoints need anyway.

Guarantees.  Every write of the lease (take, refresh, release) happens while holding `.fulltune/lease.lock`,
created with O_CREAT | O_EXCL: atomic on a local disk and on NFSv3/v4 (the server creates it), so of two jobs
starting at once exactly one takes the lease; the lease itself is written by write_json (temp file + rename), so
nobody reads half of one.  NFS's close-to-open consistency shows each reader the latest lease, since every read
opens the file again.  On object-store mounts (Cloud Storage FUSE, blobfuse, s3fs) neither exclusive create nor
rename is atomic between machines: a job started while another runs still exits 7 (it sees the refreshes), but
two started within the same second may both run; and a mount that caches contents or attributes for longer than
FT_LEASE_SECONDS / 3 hides refreshes, so keep FT_LEASE_SECONDS well above its cache time.  A holder that cannot
write for FT_LEASE_SECONDS (a stalled volume, a network partition) can lose its lease to a new job; it finds out
at its next refresh, ends its training process without saving and exits 7, and the new job goes on from the last
committed checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from trainer.core.errors import StopAbandoned, VolumeInUse
from trainer.core.files import write_json
from trainer.core.volume import Volume
from trainer.launch.pid_namespace import gone_from_this_machine, this_pid_namespace

POLL_SECONDS = 0.25  # how often a watched lease is read again: the delay added to an exit 7


@contextlib.contextmanager
def held(settings: Any, stopping: Callable[[], bool], on_lost: Callable[[], None]) -> Iterator[Lease | None]:
    """Hold the lease of FT_OUTPUT_DIR around the job (node 0 only).

    Raises VolumeInUse (exit 7) at the start while another job holds it, and at the end if another job took it
    over meanwhile (then `on_lost` was called first, to end the training process without a save).  `stopping`:
    a stop signal arrived while watching another job's lease (exit 76, nothing written)."""
    if settings.node_rank != 0:
        yield None
        return
    lease = Lease(settings.output_dir, settings.lease_seconds, on_lost)
    lease.take(stopping)
    try:
        yield lease
    finally:
        lease.release()
    if lease.lost is not None:
        raise VolumeInUse(
            f"the lease of FT_OUTPUT_DIR={lease.output_dir} was taken over by another job ({describe(lease.lost)}) after this job could not refresh it"
            f" for FT_LEASE_SECONDS={lease.seconds} (a stalled volume or a network partition?); this job stopped without saving so that two jobs never"
            " write one volume, and the other job goes on from the last committed checkpoint"
        )


def describe(holder: dict[str, Any]) -> str:
    started, refreshed = holder.get("started_at", "?"), holder.get("refreshed_at", "?")
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {started}, last refreshed {refreshed}"


class Lease:
    """This job's lease on one volume: taken by `take`, refreshed by a daemon thread, removed by `release`."""

    def __init__(self, output_dir: str, seconds: int, on_lost: Callable[[], None]):
        volume = Volume(output_dir)
        self.output_dir, self.path, self.lock = output_dir, volume.lease_file, volume.lease_lock
        self.seconds, self.on_lost = seconds, on_lost
        started = _now()
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "attempt": uuid.uuid4().hex, "started_at": started, "refreshed_at": started}
        self.record |= {"lease_seconds": seconds, **this_pid_namespace()}
        self.lost: dict[str, Any] | None = None  # the job that took the lease over
        self._released = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_every_third, name="fulltune-lease", daemon=True)

    def take(self, stopping: Callable[[], bool]) -> None:
        """Take the lease (watching another job's first, if there is one), then keep it fresh; VolumeInUse if it is alive."""
        while not self._taken(stopping):
            pass
        self._refresher.start()

    def _taken(self, stopping: Callable[[], bool]) -> bool:
        seen = self._read()
        if seen is None:
            return self._replace(None)
        holder = _parse(seen)
        if gone_from_this_machine(holder):
            taken = self._replace(seen)
            if taken:
                print(f"fulltune: took over the lease of {self.output_dir} from a job on this machine whose process is gone ({describe(holder)})", flush=True)
            return taken
        theirs = holder.get("lease_seconds")
        window = max(self.seconds, theirs if isinstance(theirs, int) else 0)
        print(f"fulltune: {self.output_dir} is leased by {describe(holder)}; watching it for up to {window} s to see whether that job still runs", flush=True)
        now = self._watch(seen, window, stopping)
        if now is None:  # released meanwhile: that job has ended
            return False
        if now != seen:
            raise VolumeInUse(
                f"FT_OUTPUT_DIR={self.output_dir} is in use by another job: {describe(_parse(now))}; its lease ({self.path}) was refreshed while this job"
                f" watched it (FT_LEASE_SECONDS={window}). Two jobs on one volume would overwrite each other's checkpoints: wait for that job to end, stop it,"
                " or give this job another FT_OUTPUT_DIR (a lease no longer refreshed for FT_LEASE_SECONDS is taken over by the next start)"
            )
        taken = self._replace(seen)
        if taken:
            print(
                f"fulltune: the lease of {self.output_dir} was not refreshed for {window} s, so its job is gone ({describe(holder)}): taking it over",
                flush=True,
            )
        return taken

    def _watch(self, seen: str, window: float, stopping: Callable[[], bool]) -> str | None:
        """The lease as it is once it changed or `window` seconds passed (None: removed)."""
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            if stopping():
                raise StopAbandoned(
                    f"stopped while waiting for the lease of {self.output_dir}; nothing was written, a retry resumes from the last committed checkpoint"
                )
            time.sleep(POLL_SECONDS)
            now = self._read()
            if now != seen:
                return now
        return seen

    def _replace(self, expected: str | None) -> bool:
        """Write this job's lease if the file still holds `expected` (None: no file); False if another job got there first."""
        with self._locked():
            if self._read() != expected:
                return False
            self._write()
            return True

    def _refresh_every_third(self) -> None:
        warned = False
        while not self._released.wait(self.seconds / 3):
            try:
                with self._locked():
                    holder = _parse(self._read() or "{}")
                    if holder.get("attempt") not in (None, self.record["attempt"]):
                        self.lost = holder  # never overwrite the job that took over: stop this one instead
                    else:
                        self._write()
            except OSError as error:  # the volume is full or stalled: try again at the next third
                if not warned:
                    why = f"cannot refresh the lease {self.path}: {error}; retrying every {self.seconds / 3:g} s"
                    print(f"fulltune: warning: {why}", file=sys.stderr, flush=True)
                    warned = True
                continue
            if self.lost is not None:
                self.on_lost()
                return

    def release(self) -> None:
        """Remove the lease if it is still this job's, so that the next start takes it at once."""
        self._released.set()
        if self._refresher.is_alive():
            self._refresher.join(timeout=self.seconds + 5)
        if self.lost is not None:
            return
        try:
            with self._locked():
                self._remove_if_mine()
        except OSError:  # a full volume: the lock's few bytes do not fit, but removing a file needs no room
            # Without the lock: a job taking over between the read and the removal would have had to write its own
            # lease, which needs the room this volume lacks.  Left in place, the next start would wait a whole lease
            # period for a job that has ended.
            with contextlib.suppress(OSError):
                self._remove_if_mine()
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))  # a job that ended before writing anything leaves the volume as it was

    def _remove_if_mine(self) -> None:
        if _parse(self._read() or "{}").get("attempt") == self.record["attempt"]:
            os.remove(self.path)

    def _write(self) -> None:
        self.record["refreshed_at"] = _now()
        write_json(self.path, self.record)

    def _read(self) -> str | None:
        return _text_or_none(self.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold lease.lock for one write.  A lock left behind is broken only when its holder is provably gone: it ran
        in this pid namespace and its pid no longer exists, or the lock stayed the same for the whole lease period
        (each write creates a new one with its own attempt and time).  Breaking on age alone would let two writers in
        when the volume merely stalls."""
        mine = json.dumps({"pid": os.getpid(), "attempt": self.record["attempt"], "at": time.monotonic(), **this_pid_namespace()})
        seen, since = None, time.monotonic()
        while True:
            try:
                os.makedirs(os.path.dirname(self.lock), exist_ok=True)
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileNotFoundError:  # the folder was removed by a job ending (release) between the two calls
                continue
            except FileExistsError:
                now = self._read_lock()
                if now != seen:  # a new holder, or the first look: its lease period starts now
                    seen, since = now, time.monotonic()
                elif self._lock_holder_gone(_parse(now or "{}")) or time.monotonic() - since > self.seconds:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.lock)  # left by a process that died within its one write
                    seen = None
                time.sleep(0.05)
                continue
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(mine)
            except OSError:  # created but not written (a full volume): an empty lock would hold every later start for a lease period
                with contextlib.suppress(OSError):
                    os.remove(self.lock)
                raise
            break
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.lock)

    def _lock_holder_gone(self, holder: dict[str, Any]) -> bool:
        """Another thread of this job (the same attempt) is not gone; a process on this machine whose pid is gone is."""
        return holder.get("attempt") != self.record["attempt"] and gone_from_this_machine(holder)

    def _read_lock(self) -> str | None:
        return _text_or_none(self.lock)


def _parse(text: str) -> dict[str, Any]:
    """The lease's fields; {} for a file that is not a lease (it is still watched, then taken over once it stops changing)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _text_or_none(path: str) -> str | None:
    """The file's text, or None when it does not exist (the lease and its lock come and go)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
