"""Python's garbage collector kept off the objects that live as long as the training process.

Once torch, transformers, TRL, MLflow and lm-eval are imported, a training process holds ~700,000 Python objects
(modules, classes, functions: alive until it ends, and the model and trainer while it trains).  Every full
collection walks all of them, 0.3-0.5 s here, whether the interpreter starts one (now and then inside a training
step: with several ranks, one rank's pause holds every other at the next collective, which is why Megatron-LM
collects by hand) or a library calls `gc.collect()` (accelerate's `free_memory`, the evaluation stage), and the
interpreter's teardown walks them again several times: ~2 s of every process's exit.  A frozen object
(`gc.freeze`) is never walked; it is still freed when its last reference goes, but not when it is only part of a
garbage cycle.  So the objects are frozen only where no cycle among them is left to free, and unfrozen by the
collection that must free them: the modules after the imports, the model and trainer while they train (the
collection after an out-of-memory error, and the one that frees their memory for the evaluation stage, walk them
again), what is left once the trainer is dropped, and everything once the job's outcome is recorded.  On the tests'
40-step demo job the training process spent 3.3-3.5 s in collections and 2.0-2.2 s in its exit; now 2.2 s and
0.3 s, and the job takes 13.0-16.0 s instead of 17.1-19.0 s (bench/demo_job_cost.py, bench/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def imported() -> None:
    """The modules just imported live as long as the process: no collection walks them (nothing else is alive yet)."""
    gc.freeze()


def settle() -> None:
    """Free what is garbage now, frozen objects included, then keep everything still alive out of later collections."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Settled for the block (training).  An error leaves it walked again, so that the collection after an
    out-of-memory error frees the failed trainer's cycles; after training the next `settle` frees them."""
    settle()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


def finished() -> None:
    """The job's outcome is recorded: nothing is left to free, so the interpreter's teardown walks nothing."""
    gc.freeze()
