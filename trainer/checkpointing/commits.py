"""What a committed checkpoint is, which one to resume from, and which ones to keep.

A checkpoint folder counts only once `commit.json` exists in it, parses, and lists every file with
its size and its xxh3-128 checksum.  The manifest is written last, after every other file is flushed to
disk; a folder without a valid manifest is a save that was cut short (transformers #35782 resumes from
those).  Before resuming, the newest committed checkpoint is read back against its checksums: bytes that
changed on the volume since the commit (a bad disk, a copy cut short, a hand edit) set it aside and the
previous committed one is used, never the damaged one.  A save whose weights are not finite never gets
here (trainer/checkpointing/divergence.py).  We chose a manifest over renaming a staging folder because rename is not atomic on object-store mounts (gcsfuse,
mountpoint-s3, SageMaker's /opt/ml/checkpoints sync).

Retention is ours, not transformers': its `_rotate_checkpoints` deletes older checkpoints *before* the
new one is complete, so a crash in the save could leave nothing to resume from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import xxhash
from transformers import TrainerCallback

from trainer.checkpointing import saving
from trainer.core import ranks
from trainer.core.files import write_json
from trainer.core.permissions import follow_umask

MANIFEST = "commit.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

CHECKSUM = "xxh3_128"  # 5.6-6 GB/s on one core from the page cache (bench/checksum.py); it finds damage, not tampering (not cryptographic)
CHUNK = 16 << 20


def _checksum(path: str) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(folder: str) -> tuple[dict[str, int], dict[str, str]]:
    """Flush every file to disk and checksum it (read back from the page cache: it was just written)."""
    sizes, checksums = {}, {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            relative = os.path.relpath(path, folder)
            sizes[relative], checksums[relative] = os.path.getsize(path), _checksum(path)
    return sizes, checksums


def commit(folder: str, step: int) -> None:
    """Flush and checksum every file of the checkpoint, then write the manifest that makes it count."""
    follow_umask(folder)  # readable by other uids, like every other file on the volume
    sizes, checksums = _fsync_tree(folder)
    sizes.pop(MANIFEST, None)
    checksums.pop(MANIFEST, None)
    write_json(os.path.join(folder, MANIFEST), {"step": step, "files": sizes, CHECKSUM: checksums, "committed_at": time.time()})


def _manifest(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        valid = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and isinstance(manifest.get(CHECKSUM), dict)
        return manifest if valid else None
    except (OSError, ValueError):
        return None


def is_committed(folder: str) -> bool:
    """The manifest exists and every file it lists has its size (cheap: checksums are read only before resuming)."""
    manifest = _manifest(folder)
    try:
        return manifest is not None and all(os.path.getsize(os.path.join(folder, name)) == size for name, size in manifest["files"].items())
    except (OSError, TypeError):
        return False


def damage(folder: str, read: bool = True) -> str | None:
    """What differs from the manifest, naming the file (None: intact).  `read`: every byte of every file is read back
    against its checksum."""
    manifest = _manifest(folder)
    if manifest is None:
        return f"{MANIFEST} is missing or unreadable"
    checksums = manifest[CHECKSUM] if read else {}
    for name, size in manifest["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{name} has {actual} bytes, {size} at commit ({'truncated' if actual < size else 'grown'})"
        if read and _checksum(path) != checksums.get(name):
            return f"{name} does not match its {CHECKSUM} checksum recorded at commit (its bytes changed)"
    return None


def _checkpoints(checkpoint_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(checkpoint_dir):
        return []
    found = [(int(m.group(1)), os.path.join(checkpoint_dir, n)) for n in os.listdir(checkpoint_dir) if (m := CHECKPOINT.match(n))]
    return sorted(found)


def committed(checkpoint_dir: str) -> list[tuple[int, str]]:
    return [(step, path) for step, path in _checkpoints(checkpoint_dir) if is_committed(path)]


def latest_for_resume(checkpoint_dir: str, quarantine_dir: str, verify: bool = True) -> str | None:
    """The newest committed checkpoint whose files match their checksums; the others are moved to `quarantine_dir`.

    Saves cut short (no manifest) are set aside and reported.  With `verify` (rank 0: the others resume from what it
    left), the newest committed checkpoint is read back; a damaged one is set aside with a warning naming the file,
    and the one before it is checked the same way.  None: nothing intact to resume from (training starts at step 0).
    """
    for step, path in _checkpoints(checkpoint_dir):
        if _manifest(path) is None:
            target = set_aside(path, quarantine_dir)
            print(f"fulltune: checkpoint at step {step} was never committed (save cut short): moved to {target}", flush=True)
        elif problem := damage(path, read=False):
            _set_aside_damaged(step, path, problem, quarantine_dir)
    if not verify:
        return last_committed(checkpoint_dir)
    for step, path in reversed(_checkpoints(checkpoint_dir)):
        problem = damage(path)
        if problem is None:
            return path
        _set_aside_damaged(step, path, problem, quarantine_dir)
    return None


def _set_aside_damaged(step: int, path: str, problem: str, quarantine_dir: str) -> None:
    target = set_aside(path, quarantine_dir, "damaged")
    print(f"fulltune: warning: checkpoint at step {step} is damaged, not resumed: {problem}; moved to {target}", flush=True)


def last_committed(checkpoint_dir: str) -> str | None:
    found = committed(checkpoint_dir)
    return found[-1][1] if found else None


def committed_bytes(folder: str | None) -> int:
    """Bytes of a committed checkpoint, from its manifest (0: none)."""
    manifest = _manifest(folder) if folder else None
    return sum(manifest["files"].values()) if manifest else 0


def set_aside_uncommitted(checkpoint_dir: str, quarantine_dir: str, why: str) -> list[tuple[int, str]]:
    """Move every checkpoint folder without a manifest (a save that just failed) aside; (step, where it is now) of each.
    One that cannot be moved (no room even for the folder `quarantine_dir`) stays: the next start sets it aside."""
    moved = []
    for step, path in _checkpoints(checkpoint_dir):
        if _manifest(path) is None:
            try:
                moved.append((step, set_aside(path, quarantine_dir, why)))
            except OSError:
                moved.append((step, path))
    return moved


def set_aside(path: str, quarantine_dir: str, why: str = "") -> str:
    """Move a checkpoint that must never be resumed out of the checkpoints folder (kept, never deleted)."""
    os.makedirs(quarantine_dir, exist_ok=True)
    target = os.path.join(quarantine_dir, f"{os.path.basename(path)}{'.' + why if why else ''}.{int(time.time())}")
    shutil.move(path, target)
    return target


def rotate(checkpoint_dir: str, keep: int, best: str | None) -> None:
    """Delete committed checkpoints beyond the newest `keep`, never the best one."""
    found = committed(checkpoint_dir)
    protected = {os.path.abspath(path) for _, path in found[-keep:]} | ({os.path.abspath(best)} if best else set())
    for _step, path in found:
        if os.path.abspath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)


class CommitCheckpoints(TrainerCallback):
    """The job's checkpoint saves (checkpointing/saving.py takes the Trainer's `_save_checkpoint` over): check the
    weights are finite, snapshot, then in the background write, commit and apply our retention.

    `every_minutes`: also save at the first evaluation step once that many minutes have passed since the last save.
    """

    def __init__(self, keep: int, refuse: TrainerCallback | None = None, every_minutes: float = 0.0, pinned: bool = False):
        self.keep = keep
        self.refuse = refuse  # divergence.RefuseNonFiniteCheckpoint: a save whose weights are not finite never counts
        self.every_seconds = every_minutes * 60
        self.saves = saving.Saves(pinned)
        self.last_save = time.monotonic()
        self.saved_step: int | None = None  # the step `save_checkpoint` saved last (a plain Trainer never calls it)

    @property
    def costs(self) -> saving.Costs:
        return self.saves.costs

    def save_checkpoint(self, trainer, trial) -> None:
        if self.refuse is not None:  # written whole in the foreground first, so that it can be set aside as it is
            self.refuse.refuse(trainer.args, trainer.state, trainer.model, write=lambda: self._write_now(trainer, trial))
        saving.save(trainer, trial, self.saves, self._commit)
        self.last_save, self.saved_step = time.monotonic(), trainer.state.global_step
        if trainer.control.should_training_stop:  # a stop, early stopping or the last step: committed before `on_save`
            self.wait_for_saves()

    def on_save(self, args, state, control, model=None, **kwargs):
        """A plain Trainer (not the job's) wrote `checkpoint-N` itself, synchronously: check and commit it here."""
        if self.saved_step == state.global_step:
            return
        if self.refuse is not None:
            self.refuse.refuse(args, state, model)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        ranks.barrier()
        if ranks.is_main():
            self._commit(folder, state.global_step, state.best_model_checkpoint)
        ranks.barrier()

    def _write_now(self, trainer, trial) -> None:
        self.saves.wait()
        saving.save(trainer, trial, self.saves, None, background=False)

    def _commit(self, folder: str, step: int, best: str | None) -> None:
        """On the main rank, once every file of the checkpoint is written (in the background)."""
        commit(folder, step)
        rotate(os.path.dirname(folder), self.keep, best)
        self.saves.costs.bytes = committed_bytes(folder)
        print(f"fulltune: committed checkpoint at step {step}: {folder}", flush=True)

    def wait_for_saves(self) -> None:
        """Every rank returns once the save in flight (on the main rank) is committed."""
        self.saves.wait()
        ranks.barrier()

    def on_train_begin(self, args, state, control, **kwargs):
        self.saves.costs.began = time.perf_counter()
        self.last_save = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        self.saves.raise_if_failed()
        if not self.every_seconds or control.should_save or state.global_step % args.eval_steps:
            return control
        # every rank decides alike (their clocks do not): the main rank's clock decides
        if ranks.any_rank(ranks.is_main() and time.monotonic() - self.last_save >= self.every_seconds):
            control.should_save = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.wait_for_saves()
        self.saves.close()

