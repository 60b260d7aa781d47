"""What a new user's data gets told: the real JSON column, file kinds by extension, Alpaca rows, weight 0, repeated eval rows."""

from __future__ import annotations

import json

import pytest
from test_data import CHAT, conversations, prepare, write_jsonl

from trainer.core.errors import DataError

GOOD = {"messages": CHAT}


def test_a_json_line_cut_short_is_reported_at_pythons_column(tmp_path):
    cut = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris is the capital of"}]})[:-20]
    try:
        json.loads(cut)
    except json.JSONDecodeError as error:
        column = error.colno  # where Python says it broke
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + cut + "\n")
    with pytest.raises(DataError, match=rf"train.jsonl line 2: not valid JSON \(Unterminated string starting at: column {column}; the line has {len(cut)} characters\)"):
        prepare(tmp_path, path)
    assert column > 1


def test_a_folder_mixing_jsonl_and_parquet_names_the_extensions(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "data" / "a.jsonl", conversations(3))
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), tmp_path / "data" / "b.parquet")
    with pytest.raises(DataError, match=r"found 2 file\(s\) of kinds \.jsonl, \.parquet$"):
        prepare(tmp_path, tmp_path / "data")
