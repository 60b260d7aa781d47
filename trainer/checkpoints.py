"""What a committed checkpoint is, which one to resume from, and which ones to keep.

A checkpoint folder counts only once `commit.json` exists in it, parses, and lists every file with
its size.  The manifest is written last, after every other file is flushed to disk; a folder without
a valid manifest is a save that was cut short (transformers #35782 resumes from those).  We chose a
manifest over renaming a staging folder because rename is not atomic on object-store mounts (gcsfuse,
mountpoint-s3, SageMaker's /opt/ml/checkpoints sync).

Retention is ours, not transformers': its `_rotate_checkpoints` deletes older checkpoints *before* the
new one is complete, so a crash in the save could leave nothing to resume from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from typing import Any

from transformers import TrainerCallback

from trainer import volume
from trainer.errors import ConfigError

MANIFEST = "commit.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Fault injection for the tests: SIGKILL this process after the checkpoint's files are written and
# before its manifest is, i.e. provably inside the save.
KILL_DURING_SAVE = "FULLTUNE_TEST_KILL_DURING_SAVE_AT_STEP"


def _fsync_tree(folder: str) -> dict[str, int]:
    sizes = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    return sizes


def commit(folder: str, step: int) -> None:
    """Flush every file of the checkpoint, then write the manifest that makes it count."""
    volume.follow_umask(folder)  # readable by other uids, like every other file on the volume
    sizes = _fsync_tree(folder)
    sizes.pop(MANIFEST, None)
    if os.environ.get(KILL_DURING_SAVE) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    manifest = {"step": step, "files": sizes, "committed_at": time.time()}
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def is_committed(folder: str) -> bool:
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        return all(os.path.getsize(os.path.join(folder, name)) == size for name, size in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _checkpoints(checkpoint_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(checkpoint_dir):
        return []
    found = [(int(m.group(1)), os.path.join(checkpoint_dir, n)) for n in os.listdir(checkpoint_dir) if (m := CHECKPOINT.match(n))]
    return sorted(found)


def committed(checkpoint_dir: str) -> list[tuple[int, str]]:
    return [(step, path) for step, path in _checkpoints(checkpoint_dir) if is_committed(path)]


def latest_for_resume(checkpoint_dir: str, quarantine_dir: str) -> str | None:
    """The newest committed checkpoint; incomplete ones are moved to `quarantine_dir` and reported."""
    for step, path in _checkpoints(checkpoint_dir):
        if not is_committed(path):
            os.makedirs(quarantine_dir, exist_ok=True)
            target = os.path.join(quarantine_dir, f"{os.path.basename(path)}.{int(time.time())}")
            shutil.move(path, target)
            print(f"fulltune: checkpoint at step {step} was never committed (save cut short): moved to {target}", flush=True)
    found = committed(checkpoint_dir)
    return found[-1][1] if found else None


def rotate(checkpoint_dir: str, keep: int, best: str | None) -> None:
    """Delete committed checkpoints beyond the newest `keep`, never the best one."""
    found = committed(checkpoint_dir)
    protected = {os.path.abspath(path) for _, path in found[-keep:]} | ({os.path.abspath(best)} if best else set())
    for _step, path in found:
        if os.path.abspath(path) not in protected:
            shutil.rmtree(path, ignore_errors=True)


class CommitCheckpoints(TrainerCallback):
    """After transformers writes `checkpoint-N`, commit it, then apply our retention."""

    def __init__(self, keep: int):
        self.keep = keep

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        commit(folder, state.global_step)
        rotate(args.output_dir, self.keep, state.best_model_checkpoint)
        print(f"fulltune: committed checkpoint at step {state.global_step}: {folder}", flush=True)


# -- What the checkpoints on a volume belong to ------------------------------------------------

FINGERPRINTED = (  # settings that change the computation; cadence and paths do not
    "model", "model_revision", "dataset", "dataset_config", "dataset_split", "dataset_revision", "eval_dataset",
    "eval_fraction", "data_format", "bad_rows", "loss_on", "max_length", "truncation", "max_steps", "learning_rate",
    "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm", "batch_size", "gradient_accumulation_steps", "seed",
)


def check_fingerprint(settings: Any, state_dir: str, extra: dict[str, str]) -> None:
    """Refuse (exit 2) to resume checkpoints written for a different computation, unless allowed."""
    current = {f"FT_{k.upper()}": str(getattr(settings, k)) for k in FINGERPRINTED} | extra
    path = os.path.join(state_dir, "fingerprint.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
        differences = [f"{k}: {recorded.get(k)!r} on the volume, {v!r} now" for k, v in current.items() if recorded.get(k) != v]
        if differences and not settings.allow_config_change:
            raise ConfigError(
                f"the checkpoints in {settings.output_dir} belong to a different configuration ("
                + "; ".join(differences)
                + "). Use a new FT_OUTPUT_DIR, restore the settings, or set FT_ALLOW_CONFIG_CHANGE=true to resume anyway."
            )
        if differences:
            print("fulltune: FT_ALLOW_CONFIG_CHANGE=true: resuming despite " + "; ".join(differences), flush=True)
    os.makedirs(state_dir, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(current, f, indent=1)
    os.replace(path + ".tmp", path)
