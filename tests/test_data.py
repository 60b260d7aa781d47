"""Every source type and row format reaches the trainer as the same checked, tokenized rows."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from trainer.core import settings
from trainer.core.errors import DataError
from trainer.data import demo
from trainer.data import prepare as data

CHAT = [{"role": "user", "content": "Reverse: apple river stone"}, {"role": "assistant", "content": "stone river apple"}]


@functools.cache
def demo_model() -> str:
    """The demo's tiny model and tokenizer (ChatML template without generation markers), built once."""
    return os.path.join(demo.ensure_demo(tempfile.mkdtemp(prefix="fulltune-demo-"), rows=300), "model")


@functools.cache
def tokenizer(template: str | None = None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model())
    if template:
        tok.chat_template = template
    return tok


def config(tmp_path: Path, dataset, **env: str):
    values = {
        "FT_OUTPUT_DIR": str(tmp_path / "out"),
        "FT_MODEL": demo_model(),
        "FT_DATASET": str(dataset),
        "FT_EVAL_FRACTION": "0",
        "FT_PLATFORM": "none",
        "FT_MAX_LENGTH": "256",
    }
    return settings.load(values | env)


def prepare(tmp_path: Path, dataset, template: str | None = None, **env: str) -> data.Prepared:
    return data.prepare(config(tmp_path, dataset, **env), tokenizer(template))


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conversations(n: int, seed: int = 7) -> list[dict]:
    return demo.conversations(n, seed)


def decoded(prepared: data.Prepared, index: int = 0) -> tuple[str, str]:
    """(whole row, trained tokens only) of one prepared training row."""
    row = prepared.train[index]
    tok = tokenizer()
    return tok.decode(row["input_ids"]), tok.decode([t for t in row["labels"] if t != -100])


# -- sources ---------------------------------------------------------------------------------------


def test_jsonl_file_trains(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "train.jsonl", conversations(20)))
    assert len(prepared.train) == 20 and set(prepared.train.column_names) == {"input_ids", "labels"}
    assert prepared.report["format"] == "messages"
    assert "<|im_start|>assistant" in decoded(prepared)[0]


def test_json_array_file_trains(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps(conversations(5)))
    assert len(prepare(tmp_path, tmp_path / "train.json").train) == 5


@pytest.mark.faults("a bad row in one parquet shard of many")
def test_folder_of_parquet_shards_trains_and_names_the_shard_of_a_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = conversations(30)
    (tmp_path / "shards").mkdir()
    for i in range(3):
        pq.write_table(pa.Table.from_pylist(rows[i * 10 : (i + 1) * 10]), tmp_path / "shards" / f"part-{i:04d}.parquet")
    assert len(prepare(tmp_path, tmp_path / "shards").train) == 30

    rows[25]["messages"][1]["role"] = "bot"
    pq.write_table(pa.Table.from_pylist(rows[20:]), tmp_path / "shards" / "part-0002.parquet")
    with pytest.raises(DataError, match=r"part-0002.parquet row 5: messages\[1\].role is 'bot'"):
        prepare(tmp_path, tmp_path / "shards")


def test_glob_of_jsonl_files_trains(tmp_path):
    write_jsonl(tmp_path / "a-1.jsonl", conversations(4, seed=1))
    write_jsonl(tmp_path / "a-2.jsonl", conversations(6, seed=2))
    write_jsonl(tmp_path / "b.jsonl", conversations(50, seed=3))
    assert len(prepare(tmp_path, tmp_path / "a-*.jsonl").train) == 10


def test_csv_with_prompt_completion_columns_trains(tmp_path):
    (tmp_path / "train.csv").write_text('prompt,completion\n"Reverse: apple river","river apple"\n"Reverse: stone cloud","cloud stone"\n')
    prepared = prepare(tmp_path, tmp_path / "train.csv")
    assert prepared.report["format"] == "prompt_completion" and len(prepared.train) == 2


def test_save_to_disk_folder_uses_the_named_split(tmp_path):
    import datasets

    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(conversations(12)), "test": datasets.Dataset.from_list(conversations(3, seed=9))})
    saved.save_to_disk(str(tmp_path / "saved"))
    assert len(prepare(tmp_path, tmp_path / "saved").train) == 12
    prepared = prepare(tmp_path, tmp_path / "saved", FT_EVAL_DATASET=str(tmp_path / "saved"))
    assert (len(prepared.train), len(prepared.eval)) == (12, 3)  # the eval source contributes its test split
    with pytest.raises(DataError, match="FT_DATASET_SPLIT.*'dev' is not one of them"):
        prepare(tmp_path, tmp_path / "saved", FT_DATASET_SPLIT="dev")


def test_a_dataset_with_a_test_split_is_evaluated_on_it_as_the_reference_recipe_does(tmp_path):
    import datasets

    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(conversations(20)), "test": datasets.Dataset.from_list(conversations(3, seed=9))})
    saved.save_to_disk(str(tmp_path / "saved"))
    prepared = prepare(tmp_path, tmp_path / "saved", FT_EVAL_FRACTION="0.1")
    assert (len(prepared.train), len(prepared.eval)) == (20, 3)  # no rows held out of train
    saved["train"].save_to_disk(str(tmp_path / "train-only"))
    prepared = prepare(tmp_path, tmp_path / "train-only", FT_EVAL_FRACTION="0.1")
    assert (len(prepared.train), len(prepared.eval)) == (18, 2)  # 90/10 when there is no test split


def test_object_store_url_is_read_through_fsspec(tmp_path):
    import fsspec

    with fsspec.open("memory://bucket/chats/train.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in conversations(8)))
    prepared = prepare(tmp_path, "memory://bucket/chats/")
    assert len(prepared.train) == 8


@pytest.mark.faults("an s3:// dataset without s3fs installed")
def test_s3_url_without_s3fs_exits_2_naming_the_package(tmp_path, monkeypatch):
    # The image has s3fs (requirements.txt); a machine installed by hand may not: hidden here, as it is there.
    # fsspec is a hard dependency (datasets requires it) and is not hidden.
    monkeypatch.setitem(sys.modules, "s3fs", None)  # `import s3fs` now raises ImportError
    with pytest.raises(DataError, match=r"needs the s3fs package.*pip install s3fs"):
        prepare(tmp_path, "s3://bucket/train.jsonl")


def test_hub_id_passes_configuration_split_and_revision(tmp_path, monkeypatch):
    import datasets

    calls = []

    def load_dataset(path, name=None, **kwargs):  # the hub is unreachable from the tests
        calls.append((path, name, kwargs))
        return datasets.Dataset.from_list(conversations(6))

    def get_dataset_split_names(path, config_name=None, **kwargs):
        calls.append(("splits of " + path, config_name, kwargs))
        return ["train_sft", "test"]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(datasets, "get_dataset_split_names", get_dataset_split_names)
    prepared = prepare(tmp_path, "org/chats", FT_DATASET_CONFIG="en", FT_DATASET_SPLIT="train_sft", FT_DATASET_REVISION="a1b2c3")
    assert calls == [
        ("splits of org/chats", "en", {"revision": "a1b2c3"}),
        ("org/chats", "en", {"revision": "a1b2c3", "split": "train_sft"}),
        ("org/chats", "en", {"revision": "a1b2c3", "split": "test"}),  # its own test split validates, as the reference recipe
    ]
    assert len(prepared.train) == 6 and len(prepared.eval) == 6


@pytest.mark.faults("the hub not answering which splits a dataset has")
def test_a_hub_that_cannot_say_which_splits_a_dataset_has_is_an_error_not_a_silent_hold_out(tmp_path, monkeypatch):
    """Only "no such dataset" answers the question; a timeout or a 429 would otherwise hold out 10 % of the training
    rows in place of the dataset's own test split, and a resume could train on other rows than its checkpoints did."""
    import datasets
    from datasets.inspect import SplitsNotFoundError

    from trainer.core.errors import HubUnreachable

    def timed_out(path, config_name=None, **kwargs):
        try:
            raise ConnectionError("Read timed out. (read timeout=10)")
        except ConnectionError as error:  # as datasets wraps it
            raise SplitsNotFoundError("The split names could not be parsed from the dataset config.") from error

    monkeypatch.setattr(datasets, "get_dataset_split_names", timed_out)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("no rows may be read without the answer"))
    with pytest.raises(HubUnreachable, match=r"FT_DATASET='org/chats': could not ask the hub which splits it has \(ConnectionError: Read timed out"):
        prepare(tmp_path, "org/chats")
    assert HubUnreachable.exit_code == 1  # a retry can help


def test_a_dataset_the_hub_does_not_have_is_reported_by_the_read_not_the_split_question(tmp_path, monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError
    from datasets.inspect import SplitsNotFoundError

    from trainer.data import sources

    def missing(path, config_name=None, **kwargs):
        try:
            raise DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub or cannot be accessed.")
        except DatasetNotFoundError as error:
            raise SplitsNotFoundError("The split names could not be parsed from the dataset config.") from error

    monkeypatch.setattr(datasets, "get_dataset_split_names", missing)
    assert sources.own_test_split("org/nothing", config(tmp_path, "org/nothing")) is None


def test_a_resume_that_would_validate_on_other_rows_exits_2_naming_the_evaluation_data(tmp_path):
    from trainer.core import config as job_config
    from trainer.core.errors import ConfigError

    built = job_config.build(config(tmp_path, "org/chats"), cuda=False, bf16_supported=False)
    job_config.check_fingerprint(built, {"evaluation data": "org/chats [test]"})
    with pytest.raises(ConfigError, match=r"evaluation data: 'org/chats \[test\]' on the volume, 'FT_EVAL_FRACTION=0.1 of org/chats, seed 42' now"):
        job_config.check_fingerprint(built, {"evaluation data": "FT_EVAL_FRACTION=0.1 of org/chats, seed 42"})
    assert job_config.fingerprint_differences(built) == []  # entrypoint.py, before the data is resolved, does not compare it


@pytest.mark.faults("a dataset path that does not exist")
def test_missing_local_file_exits_2(tmp_path):
    with pytest.raises(DataError, match="no such local file or folder"):
        prepare(tmp_path, tmp_path / "nope.jsonl")


def test_eval_fraction_holds_out_the_same_rows_every_time(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", conversations(50))
    first = prepare(tmp_path / "a", path, FT_EVAL_FRACTION="0.1")
    second = prepare(tmp_path / "b", path, FT_EVAL_FRACTION="0.1")
    assert (len(first.train), len(first.eval)) == (45, 5)
    assert first.eval["input_ids"] == second.eval["input_ids"]


# -- formats ---------------------------------------------------------------------------------------


def test_sharegpt_file_trains(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "You reverse lists."},
                {"from": "human", "value": "Reverse: apple river"},
                {"from": "gpt", "value": "river apple"},
            ]
        }
    ]
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "sharegpt.jsonl", rows), FT_LOSS_ON="assistant")
    whole, trained = decoded(prepared)
    assert prepared.report["format"] == "sharegpt"
    assert whole.startswith("<|im_start|>system\nYou reverse lists.<|im_end|>\n<|im_start|>user\nReverse: apple river")
    assert trained == "river apple<|im_end|>"


def test_prompt_completion_strings_become_a_user_and_an_assistant_turn(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Reverse: apple river", "completion": "river apple"}]), FT_LOSS_ON="assistant")
    whole, trained = decoded(prepared)
    assert whole == "<|im_start|>user\nReverse: apple river<|im_end|>\n<|im_start|>assistant\nriver apple<|im_end|>\n"
    assert trained == "river apple<|im_end|>"


def test_conversational_prompt_completion_is_joined(tmp_path):
    rows = [{"prompt": [CHAT[0]], "completion": [CHAT[1]]}]
    assert decoded(prepare(tmp_path, write_jsonl(tmp_path / "pc.jsonl", rows)))[0].count("<|im_start|>") == 2


def test_plain_text_trains_every_token_and_ends_with_eos(tmp_path):
    prepared = prepare(tmp_path, write_jsonl(tmp_path / "text.jsonl", [{"text": "apple river stone"}]))
    whole, trained = decoded(prepared)
    assert prepared.report["format"] == "text" and whole == trained == "apple river stone<|im_end|>"


def test_format_variable_overrides_detection(tmp_path):
    rows = [{"text": "apple", "conversations": [{"from": "human", "value": "Reverse: apple river"}, {"from": "gpt", "value": "river apple"}]}]
    path = write_jsonl(tmp_path / "both.jsonl", rows)
    assert prepare(tmp_path, path).report["format"] == "sharegpt"  # detection order: messages, sharegpt, prompt_completion, text
    assert prepare(tmp_path, path, FT_DATA_FORMAT="text").report["format"] == "text"


def test_conversations_stored_as_json_strings_in_a_csv_column_are_decoded(tmp_path):
    import csv

    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["messages"])
        writer.writerow([json.dumps(CHAT)])
    assert decoded(prepare(tmp_path, tmp_path / "train.csv"))[0].endswith("stone river apple<|im_end|>\n")


def test_the_data_cache_is_reused_only_while_the_tokenizer_and_its_chat_template_stay_the_same(tmp_path, capsys):
    from transformers import AutoTokenizer

    dataset = write_jsonl(tmp_path / "train.jsonl", conversations(8))
    job = config(tmp_path, dataset)

    def tokenized(tok) -> tuple[bool, list[list[int]]]:
        prepared = data.prepare(job, tok)
        reused = "reusing the checked, tokenized data" in capsys.readouterr().out
        return reused, [list(row["input_ids"]) for row in prepared.train]

    plain = AutoTokenizer.from_pretrained(demo_model())
    reused, first = tokenized(plain)
    assert not reused
    assert tokenized(AutoTokenizer.from_pretrained(demo_model())) == (True, first)  # the same tokenizer, loaded again: the cache

    other_vocabulary = AutoTokenizer.from_pretrained(demo_model())
    other_vocabulary.add_tokens(["stone river"])
    reused, rows = tokenized(other_vocabulary)
    assert not reused and rows != first  # a new token splits the rows differently

    tokenized(plain)  # the cache holds one entry: the plain tokenizer's again
    other_template = AutoTokenizer.from_pretrained(demo_model())
    other_template.chat_template = other_template.chat_template.replace("<|im_start|>", "<|im_start|> ")
    reused, rows = tokenized(other_template)
    assert not reused and rows != first  # a cache hit here would train on the old template's tokens
