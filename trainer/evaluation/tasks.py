"""FT_EVAL_TASKS: lm-evaluation-harness task names and folders of task YAMLs, checked before training.

A misspelled task found after hours of training would cost the job; so the training process builds lm-eval's
task index at start (seconds: ~9 s with lm-eval's 14,000 tasks, under 3 s for folders alone) and refuses an
unknown name with exit 2, with lm-eval's nearest names.  A task's identity for the base-score cache is its
name plus, for a folder's task, the sha256 of the folder's files (an edited YAML or row file is another task).
"""

from __future__ import annotations

import difflib
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from trainer.core.errors import ConfigError
from trainer.core.locations import eval_task_entries


@dataclass(frozen=True)
class Benchmarks:
    """The tasks to score, in order, and the lm-eval TaskManager that knows them."""

    names: tuple[str, ...]
    identities: dict[str, str]  # task name -> what the base-score cache keys it by
    manager: Any

    def __bool__(self) -> bool:
        return bool(self.names)


def resolve(spec: str) -> Benchmarks:
    """The tasks FT_EVAL_TASKS names (a folder: every task its YAMLs define), or ConfigError naming what is unknown."""
    names, folders = eval_task_entries(spec)
    if not names and not folders:
        return Benchmarks((), {}, None)
    from lm_eval.tasks import TaskManager

    manager = TaskManager(verbosity="ERROR", include_path=folders or None, include_defaults=bool(names))
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = [f"{name!r} (did you mean {', '.join(repr(m) for m in difflib.get_close_matches(name, known, n=3))}?)"
                 if difflib.get_close_matches(name, known, n=1) else repr(name) for name in unknown]
        raise ConfigError(f"FT_EVAL_TASKS: no lm-eval task {', '.join(hints)}; `lm-eval ls tasks` lists the {len(known)} this "
                          f"lm-eval knows, or name a folder of task YAMLs of your own (docs/tracking-and-serving.md#a-task-of-ones-own)")
    identities = {name: name for name in names}
    for folder in folders:
        digest = _folder_digest(folder)
        own = sorted(name for name, entry in manager.task_index.items()
                     if str(entry.yaml_path or "").startswith(folder + os.sep) and entry.kind.name == "TASK")
        if not own:
            raise ConfigError(f"FT_EVAL_TASKS: {folder} defines no lm-eval task (a YAML with `task: <name>`; docs/tracking-and-serving.md#a-task-of-ones-own)")
        identities |= {name: f"{name} ({folder}, sha256 {digest})" for name in own}
    return Benchmarks(tuple(identities), identities, manager)


def _folder_digest(folder: str) -> str:
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(folder)):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, folder).encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]
