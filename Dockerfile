# The fulltune training image: the reference job (Qwen/Qwen3-4B, full fine-tuning) on one CUDA GPU,
# configured only through FT_* variables (see the README).
#
#   docker build -t fulltune:0.1.0 .
#   docker run --rm --gpus 1 --shm-size 16g --read-only --tmpfs /tmp:exec -v "$PWD/run1:/output" fulltune:0.1.0
#
# Layers go from the least to the most often changed: system packages, torch (about 4 GB of CUDA
# wheels), the other pinned requirements, then the code; editing trainer/ rebuilds only the last layer.

# torch 2.13.0's Linux wheel on PyPI is the CUDA 13.0 build: it brings cuBLAS, cuDNN and NCCL as wheels
# (its cuda-toolkit==13.0.3 dependency).  So the "base" flavour of NVIDIA's image is all we need from it
# (CUDA runtime, the forward-compatibility libraries that let datacenter GPUs such as the H100 run it on
# older drivers, and the NVIDIA container variables); the "runtime" flavour would add a second ~3 GB copy
# of the CUDA libraries that nothing loads.
# CUDA 13 needs an R580 or newer driver on the host.  For R535-R570 hosts build the CUDA 12.6 flavour, torch's
# CUDA 12 build of 2.13 (docs/gpus.md#which-image-for-which-driver):
#   docker build --build-arg CUDA_VERSION=12.6.3 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t fulltune:cu126 .
ARG CUDA_VERSION=13.0.3
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04

# checkov:skip=CKV_DOCKER_2: a batch job serves nothing to probe; Kubernetes, AWS Batch, SageMaker, Vertex AI and Azure ML judge it by its exit code (and Kubernetes ignores HEALTHCHECK)

# tini is PID 1: it forwards SIGTERM to entrypoint.py (which forwards it to the training process, which
# commits a checkpoint and exits 75) and reaps orphaned grandchildren (DataLoader workers, torch.compile
# and triton compiler processes) that a Python PID 1 would leave as zombies.  It runs without -g: a
# signal sent to the whole process group would reach the training process twice, and a second signal
# means "give up the save" (exit 76).
# gcc, libc6-dev and python3-dev: Triton compiles the launcher of each kernel it runs with the host's C compiler
# against Python.h, at the first launch.  TRL's fused LM head runs Triton kernels on every CUDA forward (and
# FT_COMPILE, FT_LIGER compile more); without them the first step fails with "Failed to find C compiler".
# DL3008 (pin apt versions) is ignored: Ubuntu deletes superseded versions from its archive, so pins would
# break the build within weeks; the base image's tag already pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv tini gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/*

# A numeric, non-root user (Kubernetes' runAsNonRoot can only verify a numeric one); 10001 stays clear of
# host users.  /output is created and owned by it so that a fresh Docker named volume inherits the owner.
RUN groupadd --gid 10001 fulltune \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin fulltune \
    && mkdir /output \
    && chown 10001:10001 /output \
    && python3 -m venv /opt/venv

# The root filesystem may be read-only (Kubernetes readOnlyRootFilesystem, `docker run --read-only`):
# every cache goes to /tmp (a tmpfs or emptyDir) or to the output volume.  The Hugging Face cache sits on
# the volume so a retried job does not download the 8 GB of weights again.  The CUDA allocator grows its
# segments in place: padding-free passes change size every step, the caching allocator's worst case (the
# launcher sets the same for a training process started outside the image).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/output/.cache/huggingface \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    CUDA_CACHE_PATH=/tmp/.cache/nv \
    MPLCONFIGDIR=/tmp/.cache/matplotlib \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

# Kept equal to requirements.txt's pin by a test; its own layer so that other pins can change without
# reinstalling torch.  Another CUDA build: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
# with the base image of that CUDA (CUDA_VERSION above); the build fails when torch's CUDA is not the base's.
# Unset, pip uses its configured index (PyPI, or the mirror in the base image's pip.conf / PIP_INDEX_URL).
# DL3013 is ignored here only: hadolint takes the optional `${TORCH_INDEX_URL:+--index-url ...}` for an
# unpinned package; torch is pinned.
ARG CUDA_VERSION
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION" \
    && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'torch is a CPU build')" \
    && python -c "import torch, sys; base = '$CUDA_VERSION'.rsplit('.', 1)[0]; sys.exit(0 if torch.version.cuda == base else \
f'torch {torch.__version__} is built for CUDA {torch.version.cuda}, the base image is CUDA {base}: set TORCH_INDEX_URL to its cu index')"

# requirements.lock: the whole set at the versions the tests ran, so that two builds of one commit install the same packages.
COPY requirements.txt requirements.lock /app/
RUN pip install --no-cache-dir -r /app/requirements.txt -c /app/requirements.lock \
    && pip check

# The code last, owned by root: the job can read it, not change it.  Bytecode is compiled now because
# the root filesystem may be read-only at run time.
WORKDIR /app
COPY entrypoint.py /app/
COPY trainer/ /app/trainer/
RUN python -m compileall -q /app

USER 10001:10001
# The whole command is the ENTRYPOINT: SageMaker starts training images as `docker run IMAGE train`,
# and the extra "train" argument is then ignored instead of replacing the command.  No arguments runs the
# reference job with the table's defaults; `docker run IMAGE plan --card h100-80gb` prints the memory plan only.
ENTRYPOINT ["/usr/bin/tini", "--", "python", "/app/entrypoint.py"]
