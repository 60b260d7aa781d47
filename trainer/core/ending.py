"""How the job says it ended: one exit line, one termination message, and the code each rank leaves behind.

    fulltune: exit 6: volume full: /output has 0 bytes free ...     (stderr; the same line, without the prefix,
                                                                  in FT_TERMINATION_MESSAGE_PATH)

Three processes end a job (entrypoint.py, the training process, a signal handler inside it); each calls
`announce` here, so a scheduler, a person reading the log and the Kubernetes console all read the same words.
Which code an ending gets is trainer/core/errors.py's.
"""

from __future__ import annotations

import os
import sys

from trainer.core.errors import FulltuneError, OutOfMemory

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
EXIT_FILE = "FULLTUNE_EXIT_FILE"  # set by the launcher for several processes: torchrun reports any failure as 1
LAUNCHER_PID = "FULLTUNE_LAUNCHER_PID"  # set by the launcher: the training processes end with it (trainer/checkpointing/preemption.py)
_termination_path: str | None = None  # FT_TERMINATION_MESSAGE_PATH once the settings are parsed


def set_termination_message_path(path: str) -> None:
    global _termination_path
    _termination_path = path


def termination_message_path() -> str | None:
    """Where Kubernetes (and batch consoles) read the reason a container ended.

    The default is used only where it exists (Kubernetes mounts it into every container), so a run
    on a laptop as root does not create a file under /dev.  An explicit path is always written.
    Before the settings are parsed (their own errors), the raw variable is the only source.
    """
    path = _termination_path if _termination_path is not None else os.environ.get("FT_TERMINATION_MESSAGE_PATH", DEFAULT_TERMINATION_LOG)
    if path == DEFAULT_TERMINATION_LOG and not os.path.exists(path):
        return None
    return path or None


def write_termination_message(message: str) -> None:
    """Write one line to the termination-message file; never fail the exit path because of it."""
    path = termination_message_path()
    if not path:
        return
    line = " ".join(message.split())[:4000]  # Kubernetes keeps at most 4096 bytes.
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass  # Not writable outside Kubernetes (e.g. /dev/termination-log on a laptop).


def announce(code: int, why: str) -> int:
    """Print the exit line and leave the termination message; return `code`.  Safe from a signal handler."""
    print(f"fulltune: exit {code}: {why}", file=sys.stderr, flush=True)
    write_termination_message(f"exit {code}: {why}")
    return code


# How the CUDA libraries word running out of device memory when torch does not raise its own OutOfMemoryError:
# cuBLAS (a handle or workspace created at the first matmul or backward: CUBLAS_STATUS_ALLOC_FAILED), cuDNN
# (CUDNN_STATUS_ALLOC_FAILED), NCCL (a DistBackendError "... Cuda failure 'out of memory'"), a plain CUDA error
# ("CUDA error: out of memory").  Not the host's: "DefaultCPUAllocator: can't allocate memory" is not one of them.
OUT_OF_MEMORY_WORDS = ("out of memory", "_alloc_failed")  # lower case


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or another library's device out-of-memory error (above), or one that caused `error`."""
    if isinstance(error, FulltuneError):  # the job's own endings (a stop, a step-down) are never one
        return False
    seen = 0
    while error is not None and seen < 8:
        if type(error).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch
            return True
        if isinstance(error, RuntimeError) and any(word in str(error).lower() for word in OUT_OF_MEMORY_WORDS):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def exit_code_for(error: BaseException) -> int:
    """Map any exception to the documented exit code and announce it."""
    if isinstance(error, FulltuneError):
        return announce(error.exit_code, str(error))
    if is_out_of_memory(error):
        return announce(OutOfMemory.exit_code, f"out of GPU memory: {error}")
    return announce(1, f"unexpected {type(error).__name__}: {error}")


def record_exit(code: int) -> None:
    """Leave this rank's exit code where the launcher reads it (`<file>.<local rank>`), so the job's code survives torchrun."""
    path = os.environ.get(EXIT_FILE)
    if not path:
        return
    try:
        with open(f"{path}.{os.environ.get('LOCAL_RANK', '0')}", "w", encoding="utf-8") as f:
            f.write(f"{code}\n")
    except OSError:
        pass  # the exit code still reaches torchrun
