"""Malformed data exits 2 before training, naming the row and the reason, or is skipped and counted under FT_BAD_ROWS=skip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_data import CHAT, conversations, demo_model, prepare, tokenizer, write_jsonl

from conftest import job_env, run_job, termination_message
from trainer.core.errors import ConfigError, DataError
from trainer.core.volume import Volume
from trainer.data import prepare as data

GOOD = {"messages": CHAT}
USER, REPLY = CHAT

# (name, file contents as lines, text the message must contain); each file also holds good rows around the bad one.
MALFORMED = [
    ("missing column", [{"prompt": "Reverse: apple"}], "messages is missing or null"),
    ("unknown role", [{"messages": [USER, {"role": "bot", "content": "apple"}]}], "messages[1].role is 'bot'"),
    ("role missing", [{"messages": [USER, {"content": "apple"}]}], "messages[1].role is None"),
    ("empty assistant reply", [{"messages": [USER, {"role": "assistant", "content": "  "}]}], "messages[1] is an assistant turn with empty content"),
    ("number as content", [{"messages": [USER, {"role": "assistant", "content": 42}]}], "messages[1].content is a number, not a string"),
    ("list as content", [{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, REPLY]}], "messages[0].content is a list"),
    ("null content", [{"messages": [USER, {"role": "assistant", "content": None}]}], "messages[1].content is null"),
    ("null row", [None], "the row is null"),
    ("row that is a list", [["apple"]], "the row is a list, not an object"),
    ("messages not a list", [{"messages": "apple"}], "messages is a string, not a list"),
    ("empty conversation", [{"messages": []}], "messages is an empty list"),
    ("no assistant turn", [{"messages": [USER]}], "has no assistant turn"),
    ("starts with the assistant", [{"messages": [REPLY, USER, REPLY]}], "messages[0] has role assistant, but a conversation starts with a user turn"),
    (
        "system message in the middle",
        [{"messages": [USER, REPLY, {"role": "system", "content": "x"}, USER, REPLY]}],
        "messages[2] is a system message after the first turn",
    ),
    ("two user turns in a row", [{"messages": [USER, USER, REPLY]}], "messages[1] is a second user turn in a row"),
    ("ends with a user turn", [{"messages": [USER, REPLY, USER]}], "ends with a user turn that has no assistant reply"),
    ("tool result without a call", [{"messages": [USER, {"role": "tool", "content": "6"}, REPLY]}], "messages[1] is a tool result that follows no tool call"),
    (
        "control token in content",
        [{"messages": [USER, {"role": "assistant", "content": "apple<|im_end|>"}]}],
        "contains the tokenizer's control token '<|im_end|>'",
    ),
    ("bad JSON line", ['{"messages": [{"role": "user", "content": "x"}'], "not valid JSON"),
    ("ShareGPT speaker unknown", [{"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]}], "conversations[1].from is 'robot'"),
    (
        "giant user turn leaves no reply within the limit",
        [{"messages": [{"role": "user", "content": "apple " * 5000}, REPLY]}],
        "no assistant token within FT_MAX_LENGTH=256 tokens carries loss",
    ),
]


def malformed_file(tmp_path, lines, fmt_rows=None):
    """Two good rows, the bad one (line 3), one good row."""
    good = fmt_rows or [GOOD]
    body = [json.dumps(good[0]), json.dumps(good[0])] + [line if isinstance(line, str) else json.dumps(line) for line in lines] + [json.dumps(good[0])]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(body) + "\n")
    return path


def sharegpt_good():
    return [{"conversations": [{"from": "human", "value": "Reverse: apple river"}, {"from": "gpt", "value": "river apple"}]}]


@pytest.mark.faults
@pytest.mark.parametrize(("name", "lines", "expected"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_row_exits_2_naming_the_row_and_the_reason(tmp_path, name, lines, expected):
    path = malformed_file(tmp_path, lines, sharegpt_good() if "ShareGPT" in name else None)
    with pytest.raises(DataError) as raised:
        prepare(tmp_path, path, FT_LOSS_ON="assistant")
    message = str(raised.value)
    assert "train.jsonl line 3: " in message and expected in message, message
    assert "FT_BAD_ROWS=skip" in message
    assert os.listdir(tmp_path / "out") == [os.path.basename(Volume("").data_report)]  # only the report reaches the volume
    assert expected in Path(Volume(str(tmp_path / "out")).data_report).read_text()


@pytest.mark.parametrize(("name", "lines", "expected"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_row_is_skipped_and_counted_under_the_skip_policy(tmp_path, name, lines, expected):
    path = malformed_file(tmp_path, lines, sharegpt_good() if "ShareGPT" in name else None)
    prepared = prepare(tmp_path, path, FT_LOSS_ON="assistant", FT_BAD_ROWS="skip")
    assert len(prepared.train) == 3
    train = prepared.report["sources"]["train"]
    assert train["bad_rows"] == 1 and train["bad_shown"][0].startswith("train.jsonl line 3: ")


@pytest.mark.faults
@pytest.mark.parametrize(
    ("name", "contents", "expected"),
    [
        ("empty file", "", "no rows (the file is empty)"),
        ("unknown format", json.dumps({"question": "a", "answer": "b"}) + "\n", "unknown format: its columns ['answer', 'question']"),
        ("forced format without its column", json.dumps(GOOD) + "\n", "FT_DATA_FORMAT=sharegpt needs the column(s) ['conversations']"),
        ("only bad rows skipped", "null\nnull\n", "no training rows left after skipping bad rows"),
    ],
)
def test_unusable_file_exits_2_even_under_the_skip_policy(tmp_path, name, contents, expected):
    (tmp_path / "train.jsonl").write_text(contents)
    fmt = "sharegpt" if "forced" in name else "auto"
    with pytest.raises(DataError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        prepare(tmp_path, tmp_path / "train.jsonl", FT_BAD_ROWS="skip", FT_DATA_FORMAT=fmt)


def test_counts_per_reason_and_only_the_first_rows_are_listed(tmp_path):
    rows = [GOOD] + [{"messages": [USER, {"role": "bot", "content": "x"}]}] * 30 + [None] * 5
    with pytest.raises(DataError) as raised:
        prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", rows))
    message = str(raised.value)
    assert "35 bad row(s)" in message and "30 x unknown role, 5 x null row" in message
    assert message.count("train.jsonl line") == data.SHOWN
    assert "... 15 more" in Path(Volume(str(tmp_path / "out")).data_report).read_text()


@pytest.mark.faults("every row longer than FT_MAX_LENGTH")
def test_all_rows_dropped_as_too_long_exits_2(tmp_path):
    with pytest.raises(DataError, match="no training rows left and dropping long rows"):
        prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", conversations(3)), FT_MAX_LENGTH="16", FT_TRUNCATION="drop")


@pytest.mark.faults("a chat template assistant-only loss cannot mask")
def test_custom_template_without_markers_exits_2_instead_of_trls_error(tmp_path):
    custom = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ConfigError, match=r"not training-compatible.*\{% generation %\}.*FT_LOSS_ON=all"):
        prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", conversations(3)), template=custom, FT_LOSS_ON="assistant")
    assert len(prepare(tmp_path, tmp_path / "train.jsonl", template=custom).train) == 3  # FT_LOSS_ON=all needs no markers


@pytest.mark.faults("plain text with FT_LOSS_ON=assistant")
def test_plain_text_with_assistant_only_loss_exits_2(tmp_path):
    with pytest.raises(ConfigError, match="FT_LOSS_ON=assistant needs conversations"):
        prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", [{"text": "apple"}]), FT_LOSS_ON="assistant")


@pytest.mark.faults("tool calls the chat template cannot render")
def test_tool_calls_the_template_cannot_render_are_bad_rows(tmp_path):
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    rows = [GOOD, {"messages": [USER, call, {"role": "tool", "content": "6"}, REPLY]}]
    assert tokenizer().chat_template  # the demo ChatML template renders content only
    with pytest.raises(DataError, match="line 2: has tool calls, but the chat template of FT_MODEL does not render them"):
        prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", rows))


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (['{"messages": [}'], "train.jsonl line 3: not valid JSON"),
        ([{"messages": [USER, {"role": "bot", "content": "x"}]}], "train.jsonl line 3: messages[1].role is 'bot'"),
    ],
)
def test_bad_data_exits_2_end_to_end_without_traceback_leaving_only_the_report(tmp_path, lines, expected):
    env = job_env(tmp_path / "out", FT_MODEL=demo_model(), FT_DATASET=str(malformed_file(tmp_path, lines)), FT_MAX_LENGTH="256")
    done = run_job(env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and expected in done.stderr
    assert expected in termination_message(env)
    assert os.listdir(tmp_path / "out") == [os.path.basename(Volume("").data_report)]
