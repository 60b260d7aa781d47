"""What the job sends to its tracking server, sent from a thread of its own so that an outage never stalls training.

    outbox = Outbox(send, answers, where="http://mlflow:5000")
    outbox.put({"kind": "metrics", ...}, size=8, step=15)   # returns at once, whatever the server does
    outbox.drain(deadline)                                   # the end of the job: wait, bounded, for the rest
    outbox.close()                                           # what is still unsent comes back, to keep on the volume

Hand-written because MLflow's own asynchronous logging (`synchronous=False`) gives up on a batch once its
HTTP retries are spent (about four minutes at MLflow's defaults) and logs an error per batch.  Here the
items stay queued, in order, while the server does not answer: one line says so, the thread asks the server
every PROBE_SECONDS (at most PROBE_TIMEOUT_SECONDS each) whether it is back, and when it answers the queue is
sent, oldest first, with the steps and timestamps it was recorded with, and one line says how much.  Memory is
bounded: past CAPACITY queued values the oldest are dropped, and counted.

An item is plain data (a dict), so what is still queued at the end can be written to the volume and sent by
the next attempt.  An item the server refuses while it answers (twice) is left out, with one line each.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

CAPACITY = 100_000  # queued values (a metric value, a tag, an artifact each count as one): ~20 MB
PROBE_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 2.0
WHY_CHARACTERS = 160  # of the error that started an outage, in its one line
SILENT_SECONDS = 30.0  # a send that has not returned for this long is an outage too (MLflow is still retrying it)


class Outbox:
    """An ordered queue of items and the thread that sends them with `send`, asking `answers()` during an outage."""

    def __init__(self, send: Callable[[dict[str, Any]], None], answers: Callable[[], bool], where: str, scrub: Callable[[str], str] = str):
        """`where`: the server, as the log may show it; `scrub`: what makes an error message fit for the log (no password)."""
        self._send, self._answers, self._where, self._scrub = send, answers, where, scrub
        self._queue: collections.deque[tuple[dict[str, Any], int, int]] = collections.deque()  # item, values, the step it was queued at
        self._queued = 0  # values in the queue and in flight
        self._in_flight: tuple[dict[str, Any], int, int] | None = None
        self._sending_since: float | None = None
        self._changed = threading.Condition()
        self._closing = False
        self.last_step = 0
        self.down_since: str | None = None  # "step 15": an outage was announced and has not ended
        self.sent_since_down = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="fulltune-tracking", daemon=True)
        self._thread.start()

    def put(self, item: dict[str, Any], size: int = 1, step: int | None = None, first: bool = False) -> None:
        """Queue `item` (`size` values) and return at once; `first` puts it ahead of what is queued (a former attempt's)."""
        with self._changed:
            if step is not None:
                self.last_step = step
            if first:
                self._queue.appendleft((item, size, self.last_step))
            else:
                self._queue.append((item, size, self.last_step))
            self._queued += size
            while self._queued > CAPACITY and self._queue:
                _, dropped, _ = self._queue.popleft()
                self._queued -= dropped
                self.dropped += dropped
            self._changed.notify_all()
        self._check_silence()

    def drain(self, deadline: float) -> bool:
        """Wait until everything queued is sent, or until `deadline` (time.monotonic()); True when all was sent.

        A deadline already past (FT_REGISTRATION_RETRY_SECONDS=0: one try) still gives what is queued one try while the
        server answers, for up to SILENT_SECONDS: the deadline bounds the wait for a server that does not answer."""
        with self._changed:
            while self._queue or self._in_flight:
                left = max(deadline - time.monotonic(), deadline + SILENT_SECONDS - time.monotonic() if self.down_since is None else 0.0)
                if left <= 0:
                    return False
                self._changed.wait(min(left, 1.0))
                self._check_silence()
            return True

    def close(self) -> list[dict[str, Any]]:
        """Stop sending; return what was not sent (the item in flight included), oldest first."""
        with self._changed:
            self._closing = True
            unsent = ([self._in_flight[0]] if self._in_flight else []) + [item for item, _, _ in self._queue]
            self._queue.clear()
            self._changed.notify_all()
        return unsent

    def _check_silence(self) -> None:
        """A send MLflow is still retrying (its retries last minutes): announce the outage now, not when they end."""
        since = self._sending_since
        if since is not None and time.monotonic() - since > SILENT_SECONDS:
            self._announce(f"no answer for {SILENT_SECONDS:.0f} s")

    def _announce(self, why: str) -> None:
        """One line per outage, however many sends fail during it."""
        with self._changed:  # a reentrant lock: drain() calls this holding it
            if self.down_since is not None:
                return
            step = self._in_flight[2] if self._in_flight else self.last_step  # when the item that found no answer was queued
            self.down_since, self.sent_since_down = f"step {step}", 0
        print(
            f"fulltune: tracking server {self._where} not answering since {self.down_since} ({why}): training goes on; metrics, tags and "
            f"artifacts are kept in memory (up to {CAPACITY} values) and sent when it answers again (asked every {PROBE_SECONDS:.0f} s)",
            flush=True,
        )

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                self._in_flight = self._queue.popleft()
            item, size, _ = self._in_flight
            sent = self._deliver(item)
            with self._changed:
                if self._closing:
                    return
                self._in_flight = None
                self._queued -= size
                self.sent_since_down += size if sent else 0
                if not self._queue and self.down_since is not None:
                    self._print_back()
                self._changed.notify_all()

    def _deliver(self, item: dict[str, Any]) -> bool:
        """Send `item`, waiting out any outage; False when the server answers but refuses it twice (or when closing)."""
        refusals = 0
        while not self._closing:
            self._sending_since = time.monotonic()
            try:
                self._send(item)
                return True
            except Exception as error:  # noqa: BLE001 - whatever MLflow raises, the job goes on; below decides what it meant
                why = f"{type(error).__name__}: {' '.join(self._scrub(str(error)).split())[:WHY_CHARACTERS]}"
            finally:
                self._sending_since = None
            if self._answers():
                refusals += 1
                if refusals == 2:
                    print(f"fulltune: the tracking server refused {item.get('kind')} ({why}); left out", flush=True)
                    return False
                continue  # once more: MLflow may have given up just before the server came back
            self._announce(why)
            while not self._closing and not self._answers():
                with self._changed:
                    self._changed.wait(PROBE_SECONDS)
        return False

    def _print_back(self) -> None:
        dropped = f"; {self.dropped} older values dropped (more than {CAPACITY} queued)" if self.dropped else ""
        print(f"fulltune: tracking server back (down since {self.down_since}): {self.sent_since_down} buffered values sent{dropped}", flush=True)
        self.down_since, self.sent_since_down, self.dropped = None, 0, 0
