"""A copy-free snapshot on CPU: a forked child process writes the state that is frozen in its address space.

On CPU the asynchronous save's snapshot is otherwise a memory copy of the whole state, and this costs about as much
as writing it to a fast local disk (bench/RESULTS.md).  `os.fork()` takes the snapshot instead: the kernel shares
every page between the two processes and copies a page only when the training process writes it (copy-on-write),
so training waits for the fork itself (copying the page tables: tens of milliseconds per GB of state) and pays for
the pages it changes while the child still writes, at most the whole state, as the copy did.

What makes the fork safe here (docs/checkpoints.md):
- No CUDA: `Saves` forks only when the state is on CPU and CUDA was never initialised (a GPU keeps the pinned copy).
- Threads (MLflow's, the checkpoint thread, the stop deadline's timer, tokenizers' pool) do not exist in the child,
  and the locks they held stay held there, so the child runs only the Trainer's writer (safetensors, `torch.save`,
  JSON), with torch on one thread (GNU OpenMP's pool does not survive a fork: DataLoader workers do the same),
  its own stdout and stderr and no logging (a thread of the parent may hold the old streams' locks), no garbage
  collection (a finaliser could touch a socket or lock the parent owns), and ends in `os._exit`: no atexit
  handler, no flush of the parent's buffers, no process group torn down.  When the parent forks, no other thread
  runs torch: the previous save's thread has finished (one save in flight) and the training thread is the one forking.
- Signals: SIGTERM and SIGINT are blocked across the fork and ignored in the child, so a stop sent to the job's
  process group is the parent's alone (it waits for the child, then commits the stop step); the child is killed
  when the job dies (PR_SET_PDEATHSIG), so it never writes into a folder the next start has set aside.
- An error in the child (a full volume) comes back through a pipe and is raised in the parent as it was raised
  there, causes included (diskfull.py recognises it as before); a child that dies is reported with its signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import resource
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOPS = {signal.SIGTERM, signal.SIGINT}


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: a dlopen in the child could wait on a loader lock another thread held."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the child is not killed with the job
        return None


_PRCTL = _prctl() if sys.platform.startswith("linux") else None


def available() -> bool:
    """Whether a save can fork here: a POSIX process on the main thread (the child ignores signals: main thread only)."""
    return hasattr(os, "fork") and threading.current_thread() is threading.main_thread()


class WriterFailed(RuntimeError):
    """The checkpoint writer process ended without writing the checkpoint (killed, or exited without a word)."""


class Child:
    """A forked writer; `wait` (from any thread of the parent) returns once it wrote everything, else raises."""

    def __init__(self, pid: int, report: int, folder: str):
        self.pid, self.report, self.folder = pid, report, folder
        self.faults = _minor_faults()

    def touched(self) -> int:
        """Bytes of pages the parent faulted in since the fork: its copy-on-write copies, and fresh allocations."""
        return (_minor_faults() - self.faults) * resource.getpagesize()

    def wait(self) -> None:
        with os.fdopen(self.report, "rb") as f:
            report = f.read()  # until the child's end closes it: a long report never fills the pipe
        _, status = os.waitpid(self.pid, 0)
        if report:
            raise _reraised(pickle.loads(report), self.pid)  # noqa: S301 (our own child's bytes, never a file)
        if os.WIFSIGNALED(status):
            name = signal.Signals(os.WTERMSIG(status)).name
            oom = " (the kernel's out-of-memory killer sends it when memory runs out)" if name == "SIGKILL" else ""
            raise WriterFailed(f"the checkpoint writer process {self.pid} was killed by {name}{oom}; {self.folder} is not committed")
        if os.waitstatus_to_exitcode(status) != 0:
            raise WriterFailed(f"the checkpoint writer process {self.pid} exited {os.waitstatus_to_exitcode(status)}; {self.folder} is not committed")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def start(write: Callable[[], None], folder: str) -> Child:
    """Fork a child that runs `write()` on the state as it is now, then ends; raises OSError when fork fails."""
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # else the child's copy of an unflushed buffer could be written twice
        with contextlib.suppress(Exception):
            stream.flush()
    parent = os.getpid()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # a stop arriving now waits for the parent, never the child
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns that a fork in a multi-threaded process may deadlock: the child here takes no lock
            # another thread could hold (see the module's docstring).
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(write, read_end, write_end, parent, mask)
    except BaseException:
        os.close(read_end)
        os.close(write_end)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(write_end)
    return Child(pid, read_end, folder)


def _child(write: Callable[[], None], read_end: int, report: int, parent: int, mask: set) -> None:
    """The child's whole life: never returns into the parent's code."""
    code = 1
    try:
        os.close(read_end)
        for signum in STOPS:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the job died before the line above
            os._exit(code)
        gc.disable()
        _own_stdio()
        import torch

        torch.set_num_threads(1)
        write()
        code = 0
    except BaseException as error:  # noqa: BLE001 (everything goes back to the parent)
        with contextlib.suppress(BaseException):
            _send(report, error)
    finally:
        os._exit(code)


def _own_stdio() -> None:
    """Fresh sys.stdout and sys.stderr (on the same descriptors), and no logging: a thread of the parent that was
    writing at the fork holds the lock of the old streams' buffers for ever in the child.  Errors go back through
    the pipe instead."""
    import logging

    logging.disable(logging.CRITICAL)  # handlers keep the old streams
    sys.stdout = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115 (the child's life)
    sys.stderr = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115


def _send(report: int, error: BaseException) -> None:
    """The exception and its causes, each pickled when it can be (else its type and message), and the traceback."""
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        try:
            pickle.loads(pickle.dumps(seen))
            chain.append(seen)
        except Exception:  # noqa: BLE001 (an exception that does not pickle is sent as its text)
            chain.append(RuntimeError(f"{type(seen).__name__}: {seen}"))
        seen = seen.__cause__ or seen.__context__
    data = pickle.dumps((chain, "".join(traceback.format_exception(error))))
    view = memoryview(data)
    while view:
        view = view[os.write(report, view):]
    os.close(report)


def _reraised(sent: tuple[list[BaseException], str], pid: int) -> BaseException:
    chain, text = sent
    for error, cause in zip(chain, chain[1:], strict=False):
        error.__cause__ = cause
    chain[0].add_note(f"raised in the checkpoint writer process {pid}:\n{text}")
    return chain[0]
