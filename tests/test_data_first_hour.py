"""What a new user's data gets told: the real JSON column, file kinds by extension, Alpaca rows, weight 0, repeated eval rows."""

from __future__ import annotations

import json

import pytest
from test_data import CHAT, conversations, decoded, prepare, write_jsonl

from trainer.core.errors import DataError
from trainer.core.volume import Volume

GOOD = {"messages": CHAT}


def test_a_json_line_cut_short_is_reported_at_pythons_column(tmp_path):
    cut = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"},
                                   {"role": "assistant", "content": "Paris is the capital of"}]})[:-20]
    try:
        json.loads(cut)
    except json.JSONDecodeError as error:
        column = error.colno  # where Python says it broke
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + cut + "\n")
    with pytest.raises(DataError, match=r"train.jsonl line 2: not valid JSON \(Unterminated string starting "
                                        rf"at: column {column}; the line has {len(cut)} characters\)"):
        prepare(tmp_path, path)
    assert column > 1


def test_a_folder_mixing_jsonl_and_parquet_names_the_extensions(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "data" / "a.jsonl", conversations(3))
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), tmp_path / "data" / "b.parquet")
    with pytest.raises(DataError, match=r"found 2 file\(s\) of kinds \.jsonl, \.parquet$"):
        prepare(tmp_path, tmp_path / "data")


ALPACA = [
    {"instruction": "Reverse the words.", "input": "apple river stone", "output": "stone river apple"},
    {"instruction": "Say hello.", "input": "", "output": "hello"},
]


@pytest.mark.parametrize("data_format", ["auto", "alpaca"])
def test_alpaca_rows_are_detected_and_trained_as_one_exchange(tmp_path, data_format):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", ALPACA * 3), FT_DATA_FORMAT=data_format, FT_LOSS_ON="assistant")
    assert prepared.report["format"] == "alpaca" and len(prepared.train) == 6
    whole, trained = decoded(prepared)
    assert "<|im_start|>user\nReverse the words.\n\napple river stone<|im_end|>" in whole
    assert trained == "stone river apple<|im_end|>"
    assert "<|im_start|>user\nSay hello.<|im_end|>" in decoded(prepared, 1)[0]  # an empty input adds nothing


def test_an_unknown_format_says_how_to_convert_and_still_leaves_the_data_report(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"unknown format: its columns \['answer', 'question'\] match none of "
                                        r".*'instruction' \+ 'output' \(Alpaca\).*convert each row to") as caught:
        prepare(tmp_path, path)
    assert "set FT_DATA_FORMAT" not in str(caught.value)  # no value of it reads these columns
    report = Volume(str(tmp_path / "out")).data_report
    assert f"full report: {report}" in str(caught.value)
    assert "rejected before its rows were checked: FT_DATASET=" in open(report).read()


def test_an_empty_file_still_leaves_the_data_report(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(DataError, match="no rows"):
        prepare(tmp_path, tmp_path / "train.jsonl")
    assert "no rows (the file is empty)" in open(Volume(str(tmp_path / "out")).data_report).read()


USER, REPLY = CHAT
EARLIER = {"role": "assistant", "content": "wrong answer kept as context", "weight": 0}


@pytest.mark.parametrize("loss_on", ["all", "assistant"])
def test_an_assistant_turn_with_weight_0_carries_no_loss(tmp_path, loss_on):
    row = {"messages": [USER, EARLIER, {"role": "user", "content": "Try again"}, REPLY | {"weight": 1}]}
    whole, trained = decoded(prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", [row] * 2), FT_LOSS_ON=loss_on))
    assert "wrong answer kept as context" in whole and "wrong answer" not in trained
    assert "stone river apple" in trained


def test_a_weight_other_than_0_or_1_or_on_a_user_turn_is_a_bad_row(tmp_path):
    rows = [GOOD, {"messages": [USER, REPLY | {"weight": 0.5}]}, {"messages": [USER | {"weight": 0}, REPLY]}]
    with pytest.raises(DataError, match=r"(?s)2 bad row\(s\).*line 2: messages\[1\]\.weight is 0\.5 "
                                        r"\(assistant turn\); expected 0 \(not trained\) or 1") as caught:
        prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", rows))
    assert "line 3: messages[0].weight is 0 (user turn)" in str(caught.value)


def test_validation_rows_that_repeat_training_rows_are_counted_and_warned_about(tmp_path, capsys):
    rows = conversations(12)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evaluation = write_jsonl(tmp_path / "eval.jsonl", rows[:3] + conversations(2, seed=99))
    prepared = prepare(tmp_path, train, FT_EVAL_DATASET=str(evaluation))
    assert prepared.report["eval_repeats_train"] == 3
    assert "warning: 3 of 5 validation row(s) repeat a training row token for token" in capsys.readouterr().out
    assert prepare(tmp_path, train, FT_EVAL_DATASET=str(write_jsonl(tmp_path / "other.jsonl", conversations(2, seed=99))),
                   FT_DATA_CACHE="false").report["eval_repeats_train"] == 0
