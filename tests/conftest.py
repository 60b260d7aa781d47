"""Shared helpers: run entrypoint.py as a real subprocess with a clean environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def job_env(output_dir: Path | str, **settings: str) -> dict[str, str]:
    """The process environment minus any FT_*/MLFLOW_* of the caller, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_", "FULLTUNE_", "FAULT_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        FT_OUTPUT_DIR=str(output_dir),
        FT_TERMINATION_MESSAGE_PATH=str(Path(output_dir).parent / f"{Path(output_dir).name}.termination-log"),
    )
    env.update({k: str(v) for k, v in settings.items()})
    return env


def with_faults(env: dict[str, str], **faults: str) -> dict[str, str]:
    """`env` with the test-only fault injection of tests/faults/sitecustomize.py switched on (FAULT_* variables)."""
    folder = str(ROOT / "tests" / "faults")
    path = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    return env | {"PYTHONPATH": path} | {f"FAULT_{name.upper()}": str(value) for name, value in faults.items()}


def run_job(env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def start_job(env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout: float = 180, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def termination_message(env: dict[str, str]) -> str:
    path = Path(env["FT_TERMINATION_MESSAGE_PATH"])
    return path.read_text() if path.exists() else ""


def max_weight_difference(a: Path, b: Path) -> float:
    """Largest absolute difference between two safetensors files' weights (same names required)."""
    from safetensors.torch import load_file

    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys()
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


def committed_steps(output_dir: Path) -> list[int]:
    folder = Path(output_dir) / "checkpoints"
    steps = []
    for path in folder.glob("checkpoint-*"):
        manifest = path / "commit.json"
        if manifest.exists():
            steps.append(json.loads(manifest.read_text())["step"])
    return sorted(steps)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    """The demo model, tokenizer and data, built once for the tests that point FT_MODEL at them."""
    from trainer import demo

    return Path(demo.ensure_demo(str(tmp_path_factory.mktemp("demo-assets"))))
