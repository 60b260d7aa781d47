"""`--help`: what a newcomer types first.  It prints the usage and exits 0, and it starts no job: nothing is created,
nothing is downloaded, no torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from trainer.core.errors import EXIT_CODES


def _entrypoint(tmp_path, *args):
    """entrypoint.py with its arguments, run in an empty folder with FT_OUTPUT_DIR pointing into it, no hub."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_"))}
    env |= {"FT_OUTPUT_DIR": str(tmp_path / "out"), "FT_TERMINATION_MESSAGE_PATH": str(tmp_path / "termination-log"), "HF_HUB_OFFLINE": "1"}
    probe = (
        "import os, runpy, sys\n"
        "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n    print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n    raise\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(ROOT / "entrypoint.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    created = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p != cwd)
    return result, created


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_entrypoint_help_prints_the_usage_and_exits_0_without_starting_a_job(tmp_path, flag):
    result, created = _entrypoint(tmp_path, flag)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("usage: python entrypoint.py")
    for named in ("plan", "FT_PRESET=demo", "FT_OUTPUT_DIR", "FT_MODEL", "FT_DATASET", "FT_NUM_EPOCHS", "docs/settings.md"):
        assert named in result.stdout, named
    assert all(f" {code} " in result.stdout.replace("\n", " ") for code in EXIT_CODES)
    assert created == [], created  # no output folder, no termination message
    assert "no torch" in result.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_plan_help_prints_its_usage_and_exits_0_without_asking_for_a_model(tmp_path, flag):
    result, created = _entrypoint(tmp_path, "plan", flag)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("usage: entrypoint.py plan") and "--card" in result.stdout and "--json" in result.stdout
    assert created == [] and "no torch" in result.stderr
