"""No surprise code: pickle weights and code shipped with a model are refused (exit 2) before anything of them is read."""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import pytest

from conftest import NO_EVALUATION, job_env, run_job, termination_message
from trainer.core import settings as settings_table
from trainer.core.errors import ConfigError
from trainer.model import trust


class RunsOnUnpickling:
    """What a malicious pickle does: any callable, here one that leaves a file behind."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickle_only_model(demo_assets: Path, folder: Path, marker: Path) -> Path:
    """The demo model's config and tokenizer, with its weights as two pickle shards that run code when loaded."""
    shutil.copytree(demo_assets / "model", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"):
        (folder / name).write_bytes(pickle.dumps({"model.embed_tokens.weight": RunsOnUnpickling(marker)}))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00002.bin"}}))
    return folder


def custom_code_model(demo_assets: Path, folder: Path, marker: Path) -> Path:
    """A model whose config names an architecture transformers does not have, with the Python file that would define it."""
    shutil.copytree(demo_assets / "model", folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "fulltune-custom", "architectures": ["CustomForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(config))
    for module in ("configuration_custom", "modeling_custom"):
        (folder / f"{module}.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).touch()\n")
    return folder


@pytest.mark.faults
@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (pickle_only_model, "has its weights only as pickle files (pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin), "
                            "which can run code when loaded"),
        (custom_code_model, "its model_type 'fulltune-custom' is not built into transformers and needs the Python code shipped with the model "
                            "(configuration_custom.CustomConfig, modeling_custom.CustomForCausalLM); fulltune runs no code from a model unless "
                            "FT_TRUST_REMOTE_CODE=true"),
    ],
    ids=["pickle-weights", "remote-code"],
)
def test_a_model_that_would_run_its_own_code_exits_2_before_any_of_it_is_read(build, expected, demo_assets, tmp_path):
    marker = tmp_path / "code-ran"
    folder = build(demo_assets, tmp_path / "model", marker)
    out = tmp_path / "volume"
    env = job_env(out, FT_MODEL=str(folder), FT_DATASET=str(demo_assets / "data" / "train.jsonl"), FT_REGISTERED_MODEL="", **NO_EVALUATION)
    started = time.monotonic()
    result = run_job(env, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert ("FT_ALLOW_PICKLE_WEIGHTS=true" if build is pickle_only_model else "FT_TRUST_REMOTE_CODE=true") in termination_message(env)
    assert not marker.exists(), "the model's code ran"
    assert "memory plan" not in result.stdout and not (out / "checkpoints").exists() and not (out / "data-report.txt").exists()
    assert elapsed < 60, elapsed


def settings_for(model: Path, **env: str):
    return settings_table.load({"FT_MODEL": str(model), "FT_PLATFORM": "none", "FT_OUTPUT_DIR": "/unused"} | env)


@pytest.mark.faults("pickle weights beside safetensors")
def test_safetensors_beside_pickles_are_what_loads_and_pickles_alone_need_the_opt_in(demo_assets, tmp_path):
    files = ["config.json", "model.safetensors", "pytorch_model.bin", "training_args.bin"]
    trust.check_weights(settings_for(demo_assets / "model"), files)  # model.load_model takes model.safetensors
    with pytest.raises(ConfigError, match=r"only as pickle files \(pytorch_model\.bin\)"):  # training_args.bin is never loaded
        trust.check_weights(settings_for(demo_assets / "model"), [f for f in files if f != "model.safetensors"])
    trust.check_weights(settings_for(demo_assets / "model", FT_ALLOW_PICKLE_WEIGHTS="true"), ["config.json", "pytorch_model.bin"])
    with pytest.raises(ConfigError, match=r"has no weights: expected model\.safetensors"):
        trust.check_weights(settings_for(demo_assets / "model"), ["config.json", "training_args.bin"])


def test_a_built_in_model_type_that_also_ships_code_loads_the_built_in_class_without_running_it(demo_assets, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    folder = custom_code_model(demo_assets, tmp_path / "model", marker)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "qwen3"}))
    trust.check_code(settings_for(folder))
    assert "using transformers' built-in 'qwen3' instead" in capsys.readouterr().out and not marker.exists()
