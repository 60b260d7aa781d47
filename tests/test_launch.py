"""The training process's environment, as trainer/launch/launcher.py hands it to the real child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def _recorded(tmp_path, codes: dict[int, str]) -> str:
    """The outcome folder as the local ranks leave it: one `rank.<local rank>` file each, holding its exit code."""
    for rank, text in codes.items():
        (tmp_path / f"rank.{rank}").write_text(text, encoding="utf-8")
    return str(tmp_path)


@pytest.mark.parametrize(
    ("codes", "torchrun_code", "expected"),
    [
        ({}, 0, 0),  # nobody recorded: torchrun's own code
        ({}, 1, 1),  # a worker killed before recording: torchrun says 1
        ({0: "0", 1: "0"}, 0, 0),
        ({0: "0", 1: "0"}, 1, 1),  # all recorded success but torchrun failed (e.g. a rank was killed after recording)
        ({0: "5", 1: "0"}, 1, 5),  # rank 0's failure is the job's
        ({0: "0", 1: "5"}, 1, 5),  # rank 0 succeeded, another failed: that one's
        ({0: "2", 1: "5"}, 1, 2),  # both failed: rank 0's wins
        ({0: "0", 1: "6", 2: "5"}, 1, 6),  # rank 0 succeeded: the lowest failing rank's
        ({0: "0", 2: "5", 10: "6"}, 1, 5),  # ranks sort as numbers, not as text ("10" < "2")
        ({0: "", 1: "0"}, 1, 1),  # an empty record is a failure (1), not a success
        ({1: "75"}, 1, 75),  # rank 0 did not record, another did
    ],
)
def test_the_job_exit_code_follows_local_rank_0_then_the_first_failing_rank_then_torchrun(tmp_path, codes, torchrun_code, expected):
    assert launch._job_exit_code(_recorded(tmp_path, codes), torchrun_code) == expected
