"""What a committed checkpoint is: a `checkpoint-N/` folder whose `commit.json` lists every file with its size and checksum.

The manifest is written last, after every other file is flushed to disk; a folder without a valid manifest is a
save that was cut short (transformers #35782 resumes from those).  We chose a manifest over renaming a staging
folder because rename is not atomic on object-store mounts (gcsfuse, mountpoint-s3, SageMaker's
/opt/ml/checkpoints sync).  No torch here: entrypoint.py reads the volume's checkpoints before any training
process starts (trainer/checkpointing/layout.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

import xxhash

from trainer.core.files import write_json
from trainer.core.permissions import follow_umask

MANIFEST = "commit.json"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
CHECKSUM = "xxh3_128"  # 5.6-6 GB/s on one core from the page cache (bench/checksum.py); it finds damage, not tampering (not cryptographic)
CHUNK = 16 << 20


def checksum(path: str) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def commit(folder: str, step: int, read: Callable[[], None] | None = None) -> None:
    """Checksum and flush every file of the checkpoint, then write the manifest that makes it count.

    `read()` runs once every file is checksummed (read back from the page cache: they were just written), before
    the flush, which waits on the disk and not the CPU: a background save hands its core back to training there
    (checkpointing/saving.py)."""
    follow_umask(folder)  # readable by other uids, like every other file on the volume
    paths = {os.path.relpath(os.path.join(root, name), folder): os.path.join(root, name) for root, _dirs, files in os.walk(folder) for name in files}
    paths.pop(MANIFEST, None)
    checksums = {relative: checksum(path) for relative, path in paths.items()}
    if read is not None:
        read()
    for path in paths.values():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    sizes = {relative: os.path.getsize(path) for relative, path in paths.items()}
    write_json(os.path.join(folder, MANIFEST), {"step": step, "files": sizes, CHECKSUM: checksums, "committed_at": time.time()})


def read_manifest(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        valid = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and isinstance(manifest.get(CHECKSUM), dict)
        return manifest if valid else None
    except (OSError, ValueError):
        return None


def is_committed(folder: str) -> bool:
    """The manifest exists and every file it lists has its size (cheap: checksums are read only before resuming)."""
    manifest = read_manifest(folder)
    try:
        return manifest is not None and all(os.path.getsize(os.path.join(folder, name)) == size for name, size in manifest["files"].items())
    except (OSError, TypeError):
        return False


def damage(folder: str, read: bool = True) -> str | None:
    """What differs from the manifest, naming the file (None: intact).  `read`: every byte of every file is read back
    against its checksum."""
    manifest = read_manifest(folder)
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
        if read and checksum(path) != checksums.get(name):
            return f"{name} does not match its {CHECKSUM} checksum recorded at commit (its bytes changed)"
    return None


def folders(checkpoint_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-N/` folder, committed or not, oldest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    found = [(int(m.group(1)), os.path.join(checkpoint_dir, n)) for n in os.listdir(checkpoint_dir) if (m := CHECKPOINT.match(n))]
    return sorted(found)


def committed(checkpoint_dir: str) -> list[tuple[int, str]]:
    return [(step, path) for step, path in folders(checkpoint_dir) if is_committed(path)]


def last_committed(checkpoint_dir: str) -> str | None:
    found = committed(checkpoint_dir)
    return found[-1][1] if found else None


def committed_bytes(folder: str | None) -> int:
    """Bytes of a committed checkpoint, from its manifest (0: none)."""
    manifest = read_manifest(folder) if folder else None
    return sum(manifest["files"].values()) if manifest else 0
