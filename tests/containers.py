"""The container engine the container tests drive, and how they start the image.

    docker build -t fulltune:test . && FULLTUNE_IMAGE=fulltune:test python -m pytest -m container

FULLTUNE_IMAGE: the image to test, built on this machine from this tree (the rebuild test reuses its
layers).  FULLTUNE_ENGINE: `podman` or `docker` (default: podman if installed, else docker).
FULLTUNE_BUILD_ARGS: extra `build` arguments for the rebuild test (CI: its stand-in base, see
.ci/image).  Without the engine or the image the tests skip, saying how to get them; with
FULLTUNE_CONTAINER_TESTS=required (.ci/run) that is a failure, so a green CI run means they ran.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

ENGINE = os.environ.get("FULLTUNE_ENGINE") or ("podman" if shutil.which("podman") else "docker")
IMAGE = os.environ.get("FULLTUNE_IMAGE", "")
BUILD_ARGS = shlex.split(os.environ.get("FULLTUNE_BUILD_ARGS", ""))
REQUIRED = os.environ.get("FULLTUNE_CONTAINER_TESTS") == "required"
STARTED: list[Container] = []
HOW = "build the image and name it: `docker build -t fulltune:test . && FULLTUNE_IMAGE=fulltune:test python -m pytest -m container`"


def engine(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)


def require_image() -> None:
    """Skip (or, in CI, fail) the calling test when there is no engine or no image to test."""
    problem = None
    if not shutil.which(ENGINE):
        problem = f"no container engine: {ENGINE} is not installed (install podman or docker, or set FULLTUNE_ENGINE)"
    elif not IMAGE:
        problem = f"FULLTUNE_IMAGE is not set: {HOW}"
    else:
        found = engine("image", "inspect", "--format", "{{.Id}}", IMAGE)
        if found.returncode:
            problem = f"{ENGINE} cannot use image {IMAGE} ({(found.stderr.strip().splitlines() or ['?'])[-1]}): {HOW}"
    if problem:
        (pytest.fail if REQUIRED else pytest.skip)(problem)


def inspect(image: str, template: str) -> str:
    result = engine("image", "inspect", "--format", template, image)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def image_user() -> tuple[int, int]:
    """The image's numeric USER (uid, gid)."""
    uid, _, gid = inspect(IMAGE, "{{.Config.User}}").partition(":")
    return int(uid), int(gid or uid)


def volume(folder: Path, owner: tuple[int, int], mode: int = 0o755) -> Path:
    """A host folder for /output, owned as a volume prepared for the container's user would be."""
    folder.mkdir(parents=True)
    if os.geteuid() == 0:
        os.chown(folder, *owner)
        folder.chmod(mode)
    else:  # no chown without root: let any uid write it
        folder.chmod(0o777)
    return folder


class Container:
    """One `ENGINE run` of the image, started as `docker run` in the README starts it: read-only root,
    /tmp on a tmpfs, the image's own user, a host folder as /output; its output goes to `log`."""

    def __init__(self, output: Path, env: dict[str, str], log: Path, args: tuple[str, ...] = (), flags: tuple[str, ...] = (), network: str = "none"):
        """`network`: none, or `host` for a container that talks to a server the test runs on loopback (an S3 store)."""
        self.name = f"fulltune-test-{uuid.uuid4().hex[:10]}"
        self.log = log
        command = [ENGINE, "run", "--rm", "--name", self.name, "--network", network, "--read-only", "--tmpfs", "/tmp:exec"]
        if ENGINE == "podman":
            command.append("--read-only-tmpfs=false")  # podman would add tmpfs on /run and /var/tmp; docker and Kubernetes do not
        command += ["--shm-size", "1g", "--stop-timeout", "120", "-v", f"{output}:/output"]
        for key, value in env.items():
            command += ["-e", f"{key}={value}"]
        with open(log, "w") as handle:
            self.process = subprocess.Popen([*command, *flags, IMAGE, *args], stdout=handle, stderr=subprocess.STDOUT)
        STARTED.append(self)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.remove()
            raise AssertionError(f"container still running after {timeout} s:\n{self.output()[-3000:]}") from None

    def stop(self) -> None:
        """`docker stop`: SIGTERM to PID 1 (tini), SIGKILL after --stop-timeout."""
        result = engine("stop", self.name, timeout=180)
        assert result.returncode == 0, result.stderr

    def signal(self, name: str) -> None:
        result = engine("kill", "--signal", name, self.name)
        assert result.returncode == 0, result.stderr

    def exec(self, *command: str) -> subprocess.CompletedProcess:
        return engine("exec", self.name, *command)

    def remove(self) -> None:
        engine("rm", "--force", self.name)
        self.process.wait(timeout=60)


def remove_all() -> None:
    for container in STARTED:
        if container.process.poll() is None:
            container.remove()


def run(output: Path, env: dict[str, str], log: Path, args: tuple[str, ...] = (), flags: tuple[str, ...] = (), network: str = "none") -> int:
    """Run the image to its end; return its exit code."""
    return Container(output, env, log, args, flags, network).wait()
