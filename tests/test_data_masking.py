"""What is trained: the loss mask on a Qwen3 template, the length policy, the report, and the tokenized-data cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_data import CHAT, conversations, prepare, tokenizer, write_jsonl
from trl.chat_template_utils import qwen3_chat_template

from trainer.core.volume import Volume
from trainer.data import masking

SYSTEM = {"role": "system", "content": "You reverse lists of words."}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"word": "cloud"}}}]}
QWEN3_ROWS = [
    {"messages": [SYSTEM, *CHAT]},
    {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Reverse: apple river"},
            {"role": "assistant", "content": "river apple"},
            {"role": "user", "content": "Reverse: stone cloud"},
            CALL,
            {"role": "tool", "name": "lookup", "content": "a word"},
            {"role": "assistant", "content": "cloud stone"},
        ]
    },
]


def trained_spans(row) -> list[str]:
    """The decoded runs of consecutive trained tokens of one prepared row."""
    tok, spans, run = tokenizer(qwen3_chat_template), [], []
    for token, label in [*zip(row["input_ids"], row["labels"], strict=True), (None, -100)]:
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans


def test_qwen3_assistant_only_loss_trains_every_assistant_token_and_no_other(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", QWEN3_ROWS), template=qwen3_chat_template, FT_LOSS_ON="assistant")
    assert "ChatML" in prepared.report["mask"]
    # Exactly the replies as the stock template renders them, each with its <|im_end|> (Qwen3's EOS): the empty
    # think block only in the last turn, tool calls trained, and no system, user or tool-result token.
    assert trained_spans(prepared.train[0]) == ["<think>\n\n</think>\n\nstone river apple<|im_end|>"]
    assert trained_spans(prepared.train[1]) == [
        "river apple<|im_end|>",
        '<tool_call>\n{"name": "lookup", "arguments": {"word": "cloud"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\ncloud stone<|im_end|>",
    ]


def test_qwen3_stock_template_renders_the_training_text_not_trls_patched_one(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", QWEN3_ROWS), template=qwen3_chat_template, FT_LOSS_ON="assistant")
    stock = tokenizer(qwen3_chat_template).apply_chat_template(QWEN3_ROWS[1]["messages"], tokenize=False)
    assert tokenizer(qwen3_chat_template).decode(prepared.train[1]["input_ids"]) == stock  # what serving shows the model
    assert stock.count("<think>") == 1  # TRL's patched template would write one per assistant turn


def test_all_tokens_mode_trains_system_and_user_tokens_too(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", QWEN3_ROWS), template=qwen3_chat_template)
    row = prepared.train[1]
    assert row["labels"] == row["input_ids"] and prepared.report["trained_token_fraction"] == 1.0


def test_template_with_generation_markers_is_masked_by_its_markers(tmp_path):
    marked = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>"
        "{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    )
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", [{"messages": CHAT}]), template=marked, FT_LOSS_ON="assistant")
    assert "markers" in prepared.report["mask"]
    assert tokenizer().decode([t for t in prepared.train[0]["labels"] if t != -100]) == "stone river apple<|im_end|>"


def test_demo_template_assistant_fraction_is_reported(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", conversations(40)), FT_LOSS_ON="assistant")
    assert 0.2 < prepared.report["trained_token_fraction"] < 0.6
    assert "⟦" in prepared.report["example"] and "<|im_start|>user" in prepared.report["example"].split("⟦")[0]


@pytest.mark.faults
@pytest.mark.parametrize(("policy", "rows", "truncated", "dropped"), [("truncate", 5, 2, 0), ("drop", 3, 0, 2)])
def test_long_rows_are_truncated_or_dropped_and_counted(tmp_path, policy, rows, truncated, dropped):
    short = [{"messages": CHAT}] * 3
    long = [{"messages": [CHAT[0], {"role": "assistant", "content": "stone " * 40}]}] * 2
    limit = 30
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", short + long), FT_MAX_LENGTH=str(limit), FT_TRUNCATION=policy)
    source = prepared.report["sources"]["train"]
    assert len(prepared.train) == rows and max(len(ids) for ids in prepared.train["input_ids"]) <= limit
    assert (source["truncated"], source["dropped_too_long"]) == (truncated, dropped)


def test_report_has_the_length_summary_and_goes_to_the_volume(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", conversations(40)), FT_EVAL_FRACTION="0.1")
    lengths = sorted(len(ids) for ids in prepared.train["input_ids"])
    summary = prepared.report["token_lengths"]
    assert (summary["min"], summary["max"]) == (lengths[0], lengths[-1]) and summary["min"] <= summary["median"] <= summary["p95"] <= summary["max"]
    text = Path(Volume(str(tmp_path / "out")).data_report).read_text()
    assert "kept 36 train / 4 validation rows" in text and "example (trained spans in ⟦ ⟧)" in text


def test_second_start_reuses_the_cache_and_a_new_max_length_misses_it(tmp_path, monkeypatch, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", conversations(40))
    first = prepare(tmp_path, path, FT_LOSS_ON="assistant", FT_EVAL_FRACTION="0.1")

    def no_tokenizing(*_args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(masking.Masker, "encode", no_tokenizing)
    capsys.readouterr()
    second = prepare(tmp_path, path, FT_LOSS_ON="assistant", FT_EVAL_FRACTION="0.1")
    assert "reusing the checked, tokenized data" in capsys.readouterr().out
    assert second.train["input_ids"] == first.train["input_ids"] and second.eval["labels"] == first.eval["labels"]
    assert second.report == first.report

    with pytest.raises(AssertionError, match="tokenized again"):
        prepare(tmp_path, path, FT_LOSS_ON="assistant", FT_EVAL_FRACTION="0.1", FT_MAX_LENGTH="128")
    with pytest.raises(AssertionError, match="tokenized again"):
        prepare(tmp_path, path, FT_LOSS_ON="assistant", FT_EVAL_FRACTION="0.1", FT_DATA_CACHE="false")
    path.write_text(path.read_text() + path.read_text().splitlines()[0] + "\n")  # the data changed
    with pytest.raises(AssertionError, match="tokenized again"):
        prepare(tmp_path, path, FT_LOSS_ON="assistant", FT_EVAL_FRACTION="0.1")
