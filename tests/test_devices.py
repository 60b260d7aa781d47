"""entrypoint.py asks the NVIDIA driver which GPUs it has (trainer/core/devices.py): these tests give it drivers.

Each fake driver is a real shared library, compiled here, that answers the three driver calls the probe makes
(cuInit, cuDeviceGetCount, cuDeviceGetAttribute) as a machine with those GPUs would.  Installed as `libcuda.so.1`
on LD_LIBRARY_PATH, it is the driver entrypoint.py finds, the way the NVIDIA container toolkit mounts the real one.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import job_env, run_job, termination_message
from trainer.core import devices

FAKE_DRIVER = r"""
int cuInit(unsigned int flags) { return INIT_RESULT; }
int cuDeviceGetCount(int *count) { *count = COUNT; return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (attribute == 75 && device < COUNT) { *value = MAJOR; return 0; }  /* compute capability, major */
    return 101;  /* CUDA_ERROR_INVALID_DEVICE */
}
"""


def fake_driver(folder, count: int, major: int, init_result: int = 0):
    """A folder holding a `libcuda.so.1` that shows `count` GPUs of compute capability `major`.x."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a fake NVIDIA driver")
    folder.mkdir()
    (folder / "driver.c").write_text(FAKE_DRIVER)
    defines = [f"-DCOUNT={count}", f"-DMAJOR={major}", f"-DINIT_RESULT={init_result}"]
    subprocess.run([compiler, "-shared", "-fPIC", *defines, "-o", str(folder / "libcuda.so.1"), str(folder / "driver.c")], check=True)
    return folder


@pytest.mark.parametrize(("count", "major", "expected"), [(1, 9, devices.Gpus(1, True)), (8, 8, devices.Gpus(8, True)), (2, 7, devices.Gpus(2, False))])
def test_the_driver_says_how_many_gpus_and_whether_they_compute_in_bf16(tmp_path, count, major, expected):
    assert devices.visible(str(fake_driver(tmp_path / "driver", count, major) / "libcuda.so.1")) == expected


def test_no_driver_or_a_driver_that_sees_no_gpu_is_a_cpu_machine_and_says_why(tmp_path):
    missing = devices.visible(str(tmp_path / "libcuda.so.1"))
    assert (missing.count, missing.cuda) == (0, False) and "no NVIDIA driver" in missing.why_none
    hidden = devices.visible(str(fake_driver(tmp_path / "hidden", 1, 9, init_result=100) / "libcuda.so.1"))  # CUDA_ERROR_NO_DEVICE
    assert (hidden.count, hidden.cuda) == (0, False) and "CUresult 100" in hidden.why_none


def test_entrypoint_refuses_more_processes_than_the_driver_shows_gpus_before_torch_loads(tmp_path):
    env = job_env(tmp_path / "out", FT_PRESET="demo", FT_NUM_PROCESSES="2", FT_PRECISION="bf16-mixed")
    result = run_job(env | {"LD_LIBRARY_PATH": str(fake_driver(tmp_path / "driver", 1, 9))}, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FT_NUM_PROCESSES=2: only 1 GPU(s) are visible" in result.stderr


def test_bf16_on_a_gpu_without_it_exits_2_naming_the_setting(tmp_path):
    env = job_env(tmp_path / "out", FT_PRESET="demo", FT_PRECISION="bf16-mixed")
    result = run_job(env | {"LD_LIBRARY_PATH": str(fake_driver(tmp_path / "driver", 1, 7))}, timeout=60)  # a V100: compute capability 7.0
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FT_PRECISION=bf16-mixed" in result.stderr


@pytest.mark.slow
def test_a_torch_that_cannot_use_the_gpu_the_driver_shows_exits_1_instead_of_training_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = job_env(out, FT_PRESET="demo")
    result = run_job(env | {"LD_LIBRARY_PATH": str(fake_driver(tmp_path / "driver", 1, 9))}, timeout=300)  # this torch is a CPU build
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the NVIDIA driver shows a GPU but torch" in result.stderr and "Traceback" not in result.stderr
    assert "cannot use it" in termination_message(env)
    assert not (out / "checkpoints").exists()  # nothing trained
