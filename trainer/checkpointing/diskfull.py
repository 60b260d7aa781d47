"""A full output volume: recognised whichever library's write hit it, and reported as exit 6 saying what was kept.

The errno alone does not recognise it: torch.save reports ENOSPC as a bare RuntimeError from its zip writer
("unexpected pos ..."), safetensors as "I/O error: No space left on device (os error 28)", the embedded MLflow
store (SQLite) as "database or disk is full".  So the exception and its causes are searched for the errno and for
those messages; an I/O error that names neither counts when the volume has (almost) no byte left.  A full quota
(EDQUOT) that torch reports without its errno is not recognised that way (free bytes do not show a quota): it
stays exit 1, with its traceback.

The message of exit 6 is written here alone: what was being saved, about how many bytes it needs, and what is
kept, for each place a save can find the volume full (`while_training`, `while_saving_final`, `elsewhere`).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Callable, Iterator

from trainer.checkpointing import commits, manifest
from trainer.core import ranks
from trainer.core.errors import FulltuneError, VolumeFull
from trainer.core.volume import Volume, free_bytes

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_MESSAGES = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122", "database or disk is full")
NEARLY_NOTHING = 1 << 20  # bytes: no save of a model fits in less


def _chain(error: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def is_full(error: BaseException, folder: str) -> bool:
    """Whether `error` (or what caused it) is a write that found the volume holding `folder` full."""
    chain = _chain(error)
    for cause in chain:
        if isinstance(cause, OSError) and cause.errno in FULL_ERRNOS:
            return True
        if any(text in str(cause).lower() for text in FULL_MESSAGES):
            return True
    try:
        return any(isinstance(cause, (OSError, RuntimeError)) for cause in chain) and free_bytes(folder) < NEARLY_NOTHING
    except OSError:
        return False


def describe(output_dir: str, saving: str, needed: int | None, kept: str) -> str:
    """The one line of exit 6: the volume, its free bytes, what the save needed, what was kept, what to do."""
    free = free_bytes(output_dir)
    need = f"; {saving} needs about {needed:,} bytes ({needed / 1e9:.2f} GB)" if needed else f" while writing {saving}"
    return (
        f"volume full: {output_dir} has {free:,} bytes free ({free / 1e9:.2f} GB){need}. Kept: {kept}. "
        "Free space on the volume (or mount a bigger one), then run the job again: it resumes from the last committed checkpoint."
    )


@contextlib.contextmanager
def reported(output_dir: str, situation: Callable[[], tuple[str, int | None, str]]) -> Iterator[None]:
    """A full volume inside the block becomes VolumeFull (exit 6).  `situation` is asked only then, for what was being
    saved, about how many bytes it needs and what was kept (it may first set a partial save aside)."""
    try:
        yield
    except FulltuneError:
        raise
    except Exception as error:
        if not is_full(error, output_dir):
            raise
        raise VolumeFull(describe(output_dir, *situation())) from error


Situation = tuple[str, int | None, str]  # what was being saved, about how many bytes it needs, what was kept


def while_training(volume: Volume, step: int, estimate: int) -> Situation:
    """Set the checkpoint cut short aside; it needs about as much as the last committed one (else `estimate` bytes)."""
    moved = commits.set_aside_uncommitted(volume.checkpoints, volume.incomplete, "volume-full") if ranks.is_main() else []
    last = manifest.last_committed(volume.checkpoints)
    saving = f"the checkpoint at step {moved[-1][0]}" if moved else f"the next checkpoint (step {step})"
    kept = f"every committed checkpoint, the newest {last}" if last else "nothing yet (no checkpoint was committed: a retry starts from step 0)"
    partial = "".join(f"; the partial checkpoint-{moved_step} is set aside in {where}" for moved_step, where in moved)
    return saving, manifest.committed_bytes(last) or estimate, kept + partial


def while_saving_final(volume: Volume, needed: int) -> Situation:
    last = manifest.last_committed(volume.checkpoints)
    kept = f"every committed checkpoint, the newest {last} (a retry resumes there and saves the final model again)" if last else "no committed checkpoint"
    return "the final model", needed, f"{kept}; the partial final model {volume.final}.partial is removed by the retry"


def elsewhere(volume: Volume) -> Situation:
    """Any other write (the data cache, the job's state, the embedded MLflow store)."""
    last = manifest.last_committed(volume.checkpoints)
    kept = f"every committed checkpoint, the newest {last}" if last else "every file already written (no checkpoint was committed yet)"
    return "a checkpoint of this job", manifest.committed_bytes(last), kept
