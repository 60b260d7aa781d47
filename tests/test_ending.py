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
