"""How fulltune writes a file or a folder on the volume: a reader (the next attempt, a serving pod, a person)
sees the old contents or the new, never half of them, whatever kills the process in between.

    write_json(volume.status_file, {...})       # a temporary file, flushed, renamed over the old one
    append_lines(volume.eval_samples, lines)   # the same, with the old lines first
    with staged(volume.final) as partial:      # a folder built aside, then renamed into place
        ...
    with made_whole(db) as partial:            # a file another program writes (a copy, SQLite), renamed into place
        ...

Every file the job writes under FT_OUTPUT_DIR goes through here, except what the libraries write themselves
(transformers' checkpoints: their manifest, trainer/checkpointing/manifest.py, says when they count).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from typing import Any


def read_json(path: str, default: Any = None) -> Any:
    if not os.path.exists(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, value: Any) -> None:
    write_text(path, json.dumps(value, indent=1, ensure_ascii=False))


def write_text(path: str, text: str) -> None:
    """Write to a temporary file, flush it to disk, then rename it over `path`: readers see the old or the new."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".tmp"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)  # a full volume: the half-written copy would only take the room a retry needs
        raise
    os.replace(partial, path)


def append_lines(path: str, lines: Iterable[str]) -> None:
    """Add lines to a small text file by rewriting it whole (write_text): an append cut short would leave half a
    line that every later reader of a JSON-lines file trips over."""
    old = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
    write_text(path, old + "".join(line if line.endswith("\n") else line + "\n" for line in lines))


@contextlib.contextmanager
def staged(target: str) -> Iterator[str]:
    """Yield `<target>.partial` to fill; on success it replaces `target`, on failure it is left for the next try.

    A folder, unlike a file, cannot be renamed over an existing one, so the old `target` is removed just
    before the rename: a crash between the two leaves `.partial` complete, and the next attempt redoes it.
    """
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.dirname(partial) or ".", exist_ok=True)
    yield partial
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)


@contextlib.contextmanager
def made_whole(path: str) -> Iterator[str]:
    """Yield a name beside `path` for another writer (shutil, SQLite) to fill; on success it replaces `path` in one
    step, on failure it is removed.  Named by the process, so two processes making the same file never share one."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        yield partial
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
