"""How a sample answer is scored against its validation row's reference: exactly right, or not.

The one rule the log, the summary line, the run report and the tests use (an evaluation stage scores the same way):
the answer, decoded without special tokens and trimmed of surrounding whitespace, equals the reference token for
token as text.  The demo's task (trainer/data/demo.py) has one right answer per prompt, so this is its accuracy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable


def read_samples(path: str) -> list[dict]:
    """The rows of eval-samples.jsonl (written whole each time, trainer/core/files.py); none when there is no file."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def exactly_right(answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()


def tally(rows: Iterable[dict]) -> tuple[int, int]:
    """(exactly right, answered) over sample rows with `answer` and `reference`."""
    rows = list(rows)
    return sum(exactly_right(row["answer"], row["reference"]) for row in rows), len(rows)


def last_step(rows: list[dict]) -> list[dict]:
    """The rows of the latest step recorded (eval-samples.jsonl holds every evaluation's)."""
    if not rows:
        return []
    step = max(row["step"] for row in rows)
    return [row for row in rows if row["step"] == step]


def said_at_the_end(samples_path: str, report_path: str) -> str | None:
    """The log's line near its end: how many of the last evaluation's sample answers are exactly right, and where they are shown."""
    if not (rows := last_step(read_samples(samples_path))):
        return None
    right, answered = tally(rows)
    return f"fulltune: sample answers at step {rows[0]['step']}, the last evaluation: {right} of {answered} exactly right ({report_path} shows them)"
