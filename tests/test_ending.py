"""How the job says it ended: the same line on stderr and in the termination message, whichever process ends it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from trainer.core import ending, probe
from trainer.core.errors import ConfigError, VolumeFull


class OutOfMemoryError(RuntimeError):
    """Named like torch's: recognised by name, without importing torch."""


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (ConfigError("FT_LEARNING_RATE: must be > 0"), 2, "exit 2: FT_LEARNING_RATE: must be > 0"),
        (VolumeFull("volume full: /output has 0 bytes free"), 6, "exit 6: volume full: /output has 0 bytes free"),
        (OutOfMemoryError("CUDA out of memory"), 4, "exit 4: out of GPU memory: CUDA out of memory"),
        (KeyError("x"), 1, "exit 1: unexpected KeyError: 'x'"),
    ],
)
def test_an_ending_prints_one_exit_line_and_leaves_the_same_termination_message(error, code, line, tmp_path, capsys):
    ending.set_termination_message_path(str(tmp_path / "termination-log"))
    try:
        assert ending.exit_code_for(error) == code
    finally:
        ending.set_termination_message_path("")
    assert capsys.readouterr().err == f"fulltune: {line}\n"
    assert (tmp_path / "termination-log").read_text() == line + "\n"


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "NCCL error in: ProcessGroupNCCL.cpp:3640, unhandled cuda error, NCCL version 2.27.5\nLast error:\nCuda failure 'out of memory'",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
    ],
    ids=["cublas", "cudnn", "nccl", "cuda"],
)
def test_the_cuda_libraries_out_of_memory_errors_are_out_of_memory_as_torchs_own_is(message, capsys):
    import torch

    error = (torch.distributed.DistBackendError if "NCCL" in message else RuntimeError)(message)
    assert ending.is_out_of_memory(error)
    try:
        raise RuntimeError("an error while handling it") from error
    except RuntimeError as wrapped:
        assert ending.is_out_of_memory(wrapped)
    assert ending.exit_code_for(error) == 4 and "exit 4: out of GPU memory" in capsys.readouterr().err


def test_the_hosts_memory_and_other_failures_are_not_out_of_gpu_memory():
    assert not ending.is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"))
    assert not ending.is_out_of_memory(OSError(12, "Cannot allocate memory"))
    assert not ending.is_out_of_memory(ValueError("out of memory"))  # a RuntimeError's words only
    assert not ending.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_a_stop_handlers_ending_reaches_the_launcher_through_the_exit_file(tmp_path):
    """A rank that ends from a signal handler (os._exit) leaves its code where the launcher reads it: torchrun says 1."""
    code = "from trainer.core import ending; ending.announce(75, 'stopped'); ending.record_exit(75)"
    env = {"FULLTUNE_EXIT_FILE": str(tmp_path / "rank"), "LOCAL_RANK": "1", "FT_TERMINATION_MESSAGE_PATH": str(tmp_path / "log")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.stderr == "fulltune: exit 75: stopped\n"
    assert (tmp_path / "rank.1").read_text() == "75\n" and (tmp_path / "log").read_text() == "exit 75: stopped\n"


def test_a_service_is_asked_until_it_answers_and_otherwise_the_last_reason_is_reported():
    asked: list[str] = []
    replies = iter(["refused", None, "never asked"])

    def ask() -> str | None:
        asked.append("try")
        return next(replies)

    assert probe.answers(ask, tries=3, pause_seconds=0.01) is None
    assert len(asked) == 2  # answered at the second try: no third
    why = probe.answers(lambda: "Connection refused", tries=3, pause_seconds=0.01)
    assert why is not None and why.startswith("Connection refused; 3 tries in ")
