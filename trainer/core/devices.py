"""Which CUDA GPUs this process can see, asked of the NVIDIA driver itself, without importing torch.

entrypoint.py decides the device, the precision and the process count before it starts the training process.
torch's answer (`torch.cuda.is_available()`, `device_count()`, the compute capability) would cost the import of
torch, about 2 s of every start, in a process that trains nothing.  The driver API gives the same answer:
torch's own probe calls the same driver, with the same CUDA_VISIBLE_DEVICES.  The training process checks
that its torch agrees (`check_torch_agrees`), so a torch that cannot use the GPU the driver shows (a CPU build,
a driver older than torch's CUDA) ends the job with a message instead of training on the CPU.
"""

from __future__ import annotations

import ctypes
import dataclasses

from trainer.core.errors import GpuUnusable

DRIVER = "libcuda.so.1"  # what torch's CUDA runtime loads; mounted into containers by the NVIDIA container toolkit
COMPUTE_CAPABILITY_MAJOR = 75  # CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR (cuda.h)


@dataclasses.dataclass(frozen=True)
class Gpus:
    count: int  # the GPUs visible to this process (CUDA_VISIBLE_DEVICES applied)
    bf16: bool  # the first one computes in bf16 natively (compute capability 8.0 or later: A100, H100, L4, ...)
    why_none: str = ""  # when count is 0: what the driver said

    @property
    def cuda(self) -> bool:
        return self.count > 0


def visible(driver: str = DRIVER) -> Gpus:
    """The GPUs the driver shows this process; none where there is no driver (a CPU machine) or it fails to start."""
    try:
        cuda = ctypes.CDLL(driver)
    except OSError as error:
        return Gpus(0, False, f"no NVIDIA driver ({error})")
    if (code := cuda.cuInit(0)) != 0:
        return Gpus(0, False, f"cuInit failed with CUresult {code} (100: no GPU visible, e.g. CUDA_VISIBLE_DEVICES)")
    count, major = ctypes.c_int(0), ctypes.c_int(0)
    if (code := cuda.cuDeviceGetCount(ctypes.byref(count))) != 0 or count.value == 0:
        return Gpus(0, False, f"cuDeviceGetCount returned CUresult {code} and {count.value} GPUs")
    cuda.cuDeviceGetAttribute(ctypes.byref(major), COMPUTE_CAPABILITY_MAJOR, 0)  # device ordinal 0, as torch's current device
    return Gpus(count.value, major.value >= 8)


def check_torch_agrees(cuda: bool) -> None:
    """In the training process: torch sees a GPU exactly when the driver did (`cuda`, from entrypoint.py)."""
    import torch

    if torch.cuda.is_available() == cuda:
        return
    if cuda:
        raise GpuUnusable(f"the NVIDIA driver shows a GPU but torch {torch.__version__} cannot use it (torch.version.cuda="
                            f"{torch.version.cuda}): a CPU build of torch, or a driver older than its CUDA; the job would train on the CPU")
    raise GpuUnusable("torch sees a GPU that the NVIDIA driver did not show when the job started; start the job again")
