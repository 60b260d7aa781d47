"""Ask a service a few times whether it answers, before the job depends on it.

The hub (trainer/model/hub.py) and the MLflow server (trainer/tracking/server.py) are asked the same way: up to
`tries` times, 1 s, 2 s, ... apart, each try bounded by its own timeout.  The libraries' own retries would take
minutes and end in a traceback; this takes seconds and ends in a message that says what did not answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def answers(ask: Callable[[], str | None], tries: int, pause_seconds: float = 1.0) -> str | None:
    """None as soon as one `ask()` returns None (an answer); else the last reason, with how many tries took how long."""
    started = time.monotonic()
    why = None
    for attempt in range(1, tries + 1):
        why = ask()
        if why is None:
            return None
        if attempt < tries:
            time.sleep(pause_seconds * attempt)
    return f"{why}; {tries} tries in {time.monotonic() - started:.1f} s"
