"""Readers for the deployment files (Dockerfile, Kustomize overlays) and the validators the tests run.

A missing validator fails the test that needs it instead of skipping it: CI installs them all
(.ci/run), and a green run must mean every file was really checked.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
OVERLAYS = ("generic", "gke", "eks")
# checkov and azure-ai-ml pin versions that clash with the runtime stack, so .ci/run installs them here.
VALIDATORS_VENV = REPO / ".venv-deploy"


def tool(name: str) -> str:
    """Path of a validator: next to this Python (requirements-dev.txt), in .venv-deploy, or on PATH."""
    for folder in (Path(sys.executable).parent, VALIDATORS_VENV / "bin"):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if not found:
        pytest.fail(
            f"{name} is not installed: run .ci/run, or `pip install -r requirements-dev.txt` and "
            "`python3 -m venv .venv-deploy && .venv-deploy/bin/pip install -r deploy/requirements-validators.txt`"
        )
    return found


def validators_python() -> str:
    """The Python of .venv-deploy, for validators imported as libraries (azure-ai-ml)."""
    python = VALIDATORS_VENV / "bin" / "python"
    if not python.exists():
        tool(".venv-deploy/bin/python")  # fails with the install instructions
    return str(python)


def dockerfile(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # Docker drops comment lines, inside continuations too
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        keyword, _, arguments = (current + line).partition(" ")
        instructions.append((keyword.upper(), " ".join(arguments.split())))
        current = ""
    return instructions


def image_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """The variables the image sets with ENV (KEY=value form)."""
    env = {}
    for keyword, arguments in instructions:
        if keyword == "ENV":
            for item in shlex.split(arguments):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def entrypoint(instructions: list[tuple[str, str]]) -> list[str]:
    """The exec-form ENTRYPOINT (the last one wins, as in Docker)."""
    return json.loads([arguments for keyword, arguments in instructions if keyword == "ENTRYPOINT"][-1])


def render(kustomization_dir: Path | str) -> list[dict]:
    """`kubectl kustomize DIR` parsed into objects."""
    result = subprocess.run([tool("kubectl"), "kustomize", str(kustomization_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(objects: list[dict], kind: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]
