"""Local path or hub id: one rule for FT_MODEL, FT_DATASET and FT_EVAL_DATASET; a local value that does not exist exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, job_env, termination_message
from trainer.core import locations


@pytest.mark.parametrize(
    ("spec", "data", "hub"),
    [
        ("Qwen/Qwen3-4B", False, True),
        ("trl-lib/Capybara", True, True),
        ("gpt2", False, True),
        ("./models/mine", False, False),
        ("/models/mine", False, False),
        ("../mine", False, False),
        ("models/org/mine", False, False),  # two slashes: a path
        ("train.jsonl", True, False),  # a data file's extension
        ("data/*.parquet", True, False),  # a glob
        ("s3://bucket/train", True, False),
        ("my model", False, False),  # a hub id has no spaces
        ("mydata/train", True, True),  # no local folder mydata/ here: a hub id
    ],
)
def test_the_rule_decides_hub_id_or_local_path(spec, data, hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert locations.is_hub_id(spec, data=data) is hub


def test_owner_slash_name_beside_a_local_folder_of_that_owner_is_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "valid.jsonl").write_text("{}\n")
    assert not locations.is_hub_id("mydata/train", data=True)
    why = locations.missing("FT_DATASET", "mydata/train", data=True)
    assert why == (f"FT_DATASET='mydata/train': no such local file or folder ({tmp_path}/mydata/train; "
                   f"{tmp_path}/mydata holds valid.jsonl); fix the path or mount the volume that holds it")
    (tmp_path / "Qwen").mkdir()
    assert not locations.is_hub_id("Qwen/Qwen3-4B")  # a folder named like the owner makes it local: say so rather than download


def test_an_existing_folder_is_local_whatever_its_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").mkdir()
    assert not locations.is_hub_id("gpt2") and locations.missing("FT_MODEL", "gpt2") is None
    (tmp_path / "weights.bin").write_text("")
    assert "is a file; expected a folder with config.json" in locations.missing("FT_MODEL", "weights.bin")


def entrypoint(env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=cwd, capture_output=True, text=True, timeout=180)


def test_a_local_model_folder_that_does_not_exist_exits_2_with_one_line(demo_assets, tmp_path):
    env = job_env(tmp_path / "volume", FT_MODEL=str(tmp_path / "models" / "mine"), FT_DATASET=str(demo_assets / "data" / "train.jsonl"))
    result = entrypoint(env, ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"exit 2: FT_MODEL='{tmp_path}/models/mine': no such local folder ({tmp_path}/models/mine; {tmp_path} holds" in result.stderr
    assert "Traceback" not in result.stderr and "HFValidationError" not in result.stderr
    assert "no such local folder" in termination_message(env)


@pytest.mark.faults("a local FT_MODEL and FT_DATASET that do not exist, seen before the training process starts")
def test_a_missing_local_model_and_dataset_exit_2_before_the_training_process_starts_or_the_volume_is_made(tmp_path):
    env = job_env(tmp_path / "volume", FT_MODEL="./models/mine", FT_DATASET="./data/train.jsonl", FT_LOG_LEVEL="debug")
    result = entrypoint(env, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"FT_MODEL='{tmp_path}/models/mine': no such local folder" in result.stderr
    assert f"FT_DATASET='{tmp_path}/data/train.jsonl': no such local file or folder" in result.stderr
    assert "start-up:" not in result.stdout, "the training process (torch, transformers) never started"
    assert not (tmp_path / "volume").exists()


def test_a_missing_subfolder_of_a_local_data_folder_exits_2_naming_what_is_there(demo_assets, tmp_path):
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "train.jsonl").write_text((demo_assets / "data" / "train.jsonl").read_text())
    env = job_env(tmp_path / "volume", FT_MODEL=str(demo_assets / "model"), FT_DATASET="mydata/train")
    result = entrypoint(env, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    shown = f"FT_DATASET='{tmp_path}/mydata/train'"  # its real path, as everything else sees it
    assert f"exit 2: {shown}: no such local file or folder ({tmp_path}/mydata/train; {tmp_path}/mydata holds train.jsonl)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_hub_shaped_dataset_offline_and_not_cached_exits_2_saying_no_local_folder_has_that_name(demo_assets, tmp_path):
    env = job_env(tmp_path / "volume", FT_MODEL=str(demo_assets / "model"), FT_DATASET="mydata/train", HF_HOME=str(tmp_path / "hf-home"))
    result = entrypoint(env, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "exit 2: FT_DATASET='mydata/train': HF_HUB_OFFLINE=1 and the hub cache (HF_HOME) does not hold it" in result.stderr
    assert f"no local file or folder 'mydata/train' exists in {tmp_path} either, so it was taken as a hub id" in result.stderr
    assert "Traceback" not in result.stderr
