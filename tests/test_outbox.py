"""The tracking outbox (trainer/tracking/outbox.py) with a real sending thread and a send that fails on purpose."""

from __future__ import annotations

import threading
import time

from trainer.tracking import outbox as outbox_module
from trainer.tracking.outbox import Outbox


def test_past_capacity_the_oldest_values_are_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(outbox_module, "CAPACITY", 5)
    released = threading.Event()
    sent: list[int] = []

    def send(item):
        released.wait(60)  # the server is slow: everything queues behind the first item
        sent.append(item["n"])

    box = Outbox(send, answers=lambda: True, where="test")
    box.put({"n": 0}, size=1)
    deadline = time.monotonic() + 30
    while box._in_flight is None and time.monotonic() < deadline:  # the first item is in flight, the rest queue
        time.sleep(0.01)
    for n in range(1, 9):
        box.put({"n": n}, size=1)
    assert box.dropped == 4  # 9 values, room for 5: the four oldest queued ones (1..4) go
    released.set()
    assert box.drain(time.monotonic() + 30)
    assert sent == [0, 5, 6, 7, 8]
    box.close()


def test_an_item_refused_twice_while_the_server_answers_is_left_out_and_the_rest_still_go(capsys):
    attempts: dict[str, int] = {}
    sent: list[str] = []

    def send(item):
        attempts[item["kind"]] = attempts.get(item["kind"], 0) + 1
        if item["kind"] == "bad":
            raise ValueError("INVALID_PARAMETER_VALUE: password=hunter2")
        sent.append(item["kind"])

    box = Outbox(send, answers=lambda: True, where="test", scrub=lambda text: text.replace("hunter2", "***"))
    for kind in ("first", "bad", "last"):
        box.put({"kind": kind})
    assert box.drain(time.monotonic() + 30)
    box.close()
    assert sent == ["first", "last"]
    assert attempts["bad"] == 2  # once more, then left out: never retried forever
    out = capsys.readouterr().out
    assert out.count("refused bad") == 1, out
    assert "hunter2" not in out and "***" in out, out
    assert "not answering" not in out, out  # a refusal is not an outage


def test_an_item_refused_once_then_accepted_is_sent():
    calls: list[int] = []

    def send(item):
        calls.append(item["n"])
        if len(calls) == 1:
            raise ConnectionError("MLflow gave up just before the server came back")

    box = Outbox(send, answers=lambda: True, where="test")
    box.put({"n": 1})
    assert box.drain(time.monotonic() + 30)
    box.close()
    assert calls == [1, 1]


def test_a_deadline_already_past_gives_what_is_queued_one_try_while_the_server_answers_and_none_once_it_does_not():
    """FT_REGISTRATION_RETRY_SECONDS=0 ('one try'): the report logged after a registration still reaches a server that
    answers; a server whose outage was announced is not waited for."""
    slow = threading.Event()
    sent: list[int] = []

    def send(item):
        slow.wait(0.5)  # each send takes a moment, as an HTTP call does
        sent.append(item["n"])

    box = Outbox(send, answers=lambda: True, where="test")
    box.put({"n": 1})
    box.put({"n": 2})
    assert box.drain(time.monotonic() - 1)
    assert sent == [1, 2]
    box.close()

    def refuse(item):
        raise ConnectionError("connection refused")

    down = Outbox(refuse, answers=lambda: False, where="test")
    down.put({"n": 3})
    began = time.monotonic()
    assert not down.drain(time.monotonic() - 1)
    assert time.monotonic() - began < outbox_module.SILENT_SECONDS / 2
    assert down.close() == [{"n": 3}]
