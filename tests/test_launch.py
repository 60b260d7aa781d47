"""The training process's environment, as trainer/launch/launcher.py hands it to the real child process."""

from __future__ import annotations

import os
import subprocess
import sys

from trainer.launch import launcher as launch

PROBE = "import os, torch; print(repr(os.environ.get('OMP_NUM_THREADS')), torch.get_num_threads())"


def _training_process_sees(monkeypatch, omp_num_threads: str | None) -> subprocess.CompletedProcess:
    """Run the training process's command and environment with the job replaced by a probe."""
    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    cmd, env = launch.accelerate_command(use_cpu=True)
    assert cmd[1:] == ["-m", "trainer"], cmd
    return subprocess.run([cmd[0], "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_without_omp_num_threads_the_training_process_keeps_torchs_default_thread_count(monkeypatch):
    plain = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=plain, capture_output=True, text=True, timeout=120)
    result = _training_process_sees(monkeypatch, None)
    assert "Invalid value" not in result.stderr, result.stderr  # libgomp's complaint about OMP_NUM_THREADS=None
    assert result.stdout.split() == ["None", default.stdout.strip()], result.stdout


def test_the_callers_omp_num_threads_reaches_the_training_process(monkeypatch):
    result = _training_process_sees(monkeypatch, "1")
    assert result.stdout.split() == ["'1'", "1"], result.stdout + result.stderr
