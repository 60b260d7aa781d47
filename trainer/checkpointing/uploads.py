"""The mirror's uploads, on a thread of their own: training never waits for the bucket.

    uploads = Uploads(mirror, volume, keep=2)
    uploads.committed()          # from the save's thread, after each commit: returns at once
    uploads.final()              # the final model is saved: upload it too
    uploads.settle(seconds)      # the end of the job: wait, bounded, until the mirror holds what the volume holds

Each round makes the mirror hold the volume's committed checkpoints: the fingerprint first, then the newest checkpoint
the mirror lacks, then the next newest, and so on (one upload in flight; a checkpoint that a newer commit made
retention remove from the volume before its upload is superseded and never sent), then FT_SAVE_TOTAL_LIMIT and the best
applied to the mirror, then the final model once it is saved.  A round that fails (the store does not answer,
refuses, or an upload comes out short) is tried again after 1 s, 2 s, ... up to LONGEST_PAUSE_SECONDS; one line says
when the mirror stops answering and one when it answers again, however many rounds fail in between.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from trainer.checkpointing import manifest as manifests
from trainer.checkpointing.mirror import CHECKPOINTS, FINAL, Gone, Mirror, same
from trainer.core import objectstore
from trainer.core.files import read_json
from trainer.core.volume import Volume

FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS = 1.0, 30.0
WHY_CHARACTERS = 200  # of the error that started an outage, in its one line


class Uploads:
    """The thread that keeps one mirror up to date with one volume (rank 0 only)."""

    def __init__(self, mirror: Mirror, volume: Volume, keep: int):
        self.mirror, self.volume, self.keep = mirror, volume, keep
        self._changed = threading.Condition()
        self._wanted = self._done = 0  # rounds asked for, and the last asked for when a round succeeded
        self._final = False  # the final model is saved: rounds upload it too
        self._fingerprint_sent = False
        self._closing = False
        self.final_mirrored = False
        self.last_mirrored: int | None = None  # the newest step the mirror is known to hold
        self.down_since: str | None = None
        self.last_error = ""
        self.sent_bytes, self.sent_seconds = 0, 0.0  # what the uploads cost, for the docs' measured rate
        self._thread = threading.Thread(target=self._run, name="fulltune-mirror", daemon=True)
        self._thread.start()

    def committed(self, _folder: str | None = None) -> None:
        """A checkpoint was committed (or the job starts with some on the volume): a round, at once or after the one in flight."""
        with self._changed:
            self._wanted += 1
            self._changed.notify_all()

    def final(self) -> None:
        with self._changed:
            self._final = True
            self._wanted += 1
            self._changed.notify_all()

    def settle(self, seconds: float) -> bool:
        """Wait up to `seconds` until a round asked for by now has succeeded; True when it has."""
        deadline = time.monotonic() + seconds
        with self._changed:
            target = self._wanted
            self._changed.notify_all()  # a round waiting out its back-off tries again now
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 1.0))
            return True

    def behind(self) -> str:
        """What the mirror lacks, in words, for the exit message."""
        newest = manifests.last_committed(self.volume.checkpoints)
        parts = [] if self.final_mirrored or not self._final else ["the final model"]
        if newest and self.last_mirrored != int(newest.rsplit("-", 1)[1]):
            parts.append(f"{os.path.basename(newest)}")
        return " and ".join(parts) or "the last round of uploads"

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()

    def _run(self) -> None:
        pause = FIRST_PAUSE_SECONDS
        while True:
            with self._changed:
                while self._done >= self._wanted and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                target = self._wanted
            try:
                self._round()
            except Exception as error:  # noqa: BLE001 - whatever the store's client raises, training goes on; the round is tried again
                self.last_error = f"{type(error).__name__}: {' '.join(objectstore.scrub(str(error)).split())[:WHY_CHARACTERS]}"
                self._announce()
                with self._changed:
                    if not self._closing:
                        self._changed.wait(pause)
                pause = min(pause * 2, LONGEST_PAUSE_SECONDS)
                continue
            pause = FIRST_PAUSE_SECONDS
            if self.down_since is not None:
                print(f"fulltune: mirror {self.mirror.shown} back (down since {self.down_since}): "
                      f"{'the final model and ' if self.final_mirrored else ''}every committed checkpoint on the volume is in it", flush=True)
                self.down_since = None
            with self._changed:
                self._done = max(self._done, target)
                self._changed.notify_all()

    def _announce(self) -> None:
        if self.down_since is not None:
            return
        newest = manifests.last_committed(self.volume.checkpoints)
        self.down_since = f"step {newest.rsplit('-', 1)[1]}" if newest else "the start"
        print(f"fulltune: mirror {self.mirror.shown} not answering since {self.down_since} ({self.last_error}): training goes on; "
              f"uploads are retried every {LONGEST_PAUSE_SECONDS:.0f} s at most, the newest committed checkpoint first", flush=True)

    def _round(self) -> None:
        if not self._fingerprint_sent:
            # the volume's own record: the settings and what they resolved to (the validation rows' source), so that a
            # resume from the mirror onto an empty volume compares the same things a resume from the volume does
            self.mirror.put_fingerprint(read_json(self.volume.fingerprint_file, {}))
            self._fingerprint_sent = True
        remote = self.mirror.committed()
        while pending := [(step, path, local) for step, path in reversed(manifests.committed(self.volume.checkpoints))
                          if (local := manifests.read_manifest(path)) is not None and not same(remote.get(step), local)]:
            step, path, local = pending[0]
            began = time.perf_counter()
            try:
                sent = self.mirror.upload_checkpoint(path, local)
            except Gone:
                continue  # removed by retention while it went up: the newest is listed again
            self._count(sent, began)
            remote[step] = local
            print(f"fulltune: mirrored checkpoint at step {step}: {self.mirror.where(CHECKPOINTS, os.path.basename(path))}"
                  f" ({sent / 1e6:.1f} MB in {time.perf_counter() - began:.1f} s)", flush=True)
        newest = manifests.last_committed(self.volume.checkpoints)
        if newest is not None:
            self.mirror.apply_retention(self.keep, best_step(newest))
            self.last_mirrored = int(newest.rsplit("-", 1)[1])
        if self._final and not self.final_mirrored:
            began = time.perf_counter()
            sent = self.mirror.upload_final(self.volume.final)
            self._count(sent, began)
            self.final_mirrored = True
            print(f"fulltune: mirrored the final model: {self.mirror.where(FINAL)} ({sent / 1e6:.1f} MB in {time.perf_counter() - began:.1f} s)", flush=True)

    def _count(self, sent: int, began: float) -> None:
        if sent:
            self.sent_bytes += sent
            self.sent_seconds += time.perf_counter() - began


def after_stop(uploads: Uploads | None, stopper: Any) -> None:
    """A stop (preemption.StopOnSignal): the mirror gets the stop's checkpoint within what is left of FT_STOP_DEADLINE_SECONDS;
    the job exits 75 either way (the checkpoint is committed on the volume), or 76 for a stop before the first step."""
    if uploads is None or not stopper.requested:
        return
    left = stopper.deadline_seconds - (time.monotonic() - stopper.requested_at)
    if not uploads.settle(max(left, 0.0)):
        print(f"fulltune: warning: the mirror {uploads.mirror.shown} has not received {uploads.behind()} before the stop deadline"
              f" ({uploads.last_error or 'still uploading'}); a restart on this volume uploads it, one on an empty volume resumes from the mirror's newest",
              flush=True)


def best_step(checkpoint: str) -> int | None:
    """The best checkpoint's step as the Trainer recorded it in `checkpoint` (its trainer_state.json), or None."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            best = json.load(f).get("best_global_step")
    except (OSError, ValueError):
        return None
    return int(best) if best else None
