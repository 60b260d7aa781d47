"""Canaries: each library internal fulltune relies on (docs/architecture.md, "Library internals that stay") is still
there with the parameters fulltune passes, and the checkpoint save still goes through the job's background path.

A renamed private method would not raise: transformers would call its own new method and skip the override, and
saves would silently become synchronous and uncommitted.  Each check here fails first, naming the internal.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

# (where, name, the parameters fulltune calls it with or overrides it with)
TRAINER_METHODS = [
    ("_save_checkpoint", ["model", "trial"]),  # checkpointing/job_trainer.py overrides it: the save taken over
    ("_load_best_model", []),  # overridden: waits for the save in flight
    ("_build_accelerator_args", []),  # overridden (**kwargs): DDP's gradient_as_bucket_view
    ("create_accelerator_and_postprocess", []),  # overridden under FSDP on CPU processes
    ("_get_output_dir", ["trial"]),  # checkpointing/saving.py calls these, as transformers' own _save_checkpoint does
    ("_save_optimizer_and_scheduler", ["output_dir"]),
    ("_save_scaler", ["output_dir"]),
    ("_save_rng_state", ["output_dir"]),
    ("_save", ["output_dir", "state_dict"]),  # and publishing/final_model.py, for the model gathered from its FSDP shards
    ("store_flos", []),
]


@pytest.mark.parametrize(("name", "parameters"), TRAINER_METHODS, ids=[name for name, _ in TRAINER_METHODS])
def test_the_trainer_internals_fulltune_overrides_or_calls_are_still_there(name, parameters):
    from transformers import Trainer

    method = getattr(Trainer, name, None)
    assert callable(method), f"transformers' Trainer.{name} is gone: see docs/architecture.md, library internals"
    accepted = inspect.signature(method).parameters
    assert [p for p in parameters if p not in accepted] == [], f"Trainer.{name} no longer takes {parameters}"


def test_the_accelerate_and_environs_internals_are_still_there():
    from accelerate import ParallelismConfig, PartialState
    from environs import Env

    assert isinstance(PartialState._shared_state, dict)  # model/fsdp_on_cpu.py: FSDP on CPU processes
    assert callable(ParallelismConfig._validate_accelerator)
    assert "env_key" in inspect.signature(Env._get_value).parameters  # core/precedence.py: parsing a mapping


def test_trls_collator_is_importable_where_fulltune_imports_it():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # model/recipe.py (TRL does not export it)

    assert "padding_free" in inspect.signature(DataCollatorForLanguageModeling).parameters


def test_mlflows_store_registry_answers_a_uri_without_building_its_store():
    """tracking/store.py's check_scheme: exit 2 for a URI this MLflow has no store for, asked of the registry without
    building the store (which, for a fresh SQLite file, creates its tables)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils as tracking_stores

    registry = tracking_stores._tracking_store_registry
    assert callable(registry.get_store_builder("sqlite:///nowhere/mlflow.db"))
    with pytest.raises(mlflow.tracking.registry.UnsupportedModelRegistryStoreURIException):
        registry.get_store_builder("nosuchscheme://host/path")


def test_the_evaluation_stage_switches_off_every_tqdm_bar_lm_eval_draws_and_puts_tqdm_back():
    """evaluation/harness.py's _no_progress_bars patches tqdm.std.tqdm.__init__: lm-eval passes disable=False itself,
    and tqdm reads TQDM_DISABLE only when first imported."""
    from tqdm import std, tqdm
    from tqdm.asyncio import tqdm as async_tqdm  # lm-eval's API models draw this one

    from trainer.evaluation.harness import _no_progress_bars

    kept = vars(std.tqdm)["__init__"]
    assert tqdm is std.tqdm and "disable" in inspect.signature(std.tqdm.__init__).parameters
    with _no_progress_bars(quiet=True):
        assert tqdm(range(3), disable=False).disable and async_tqdm(range(3), disable=False).disable
    assert vars(std.tqdm)["__init__"] is kept and not tqdm(range(3), disable=False, file=open(os.devnull, "w")).disable


def test_lm_eval_still_calls_the_two_helpers_the_evaluation_stage_replaces_and_the_environment_is_gathered_once(monkeypatch):
    """evaluation/harness.py replaces `get_git_commit_hash` and `add_env_info` in lm_eval.evaluator, which
    `simple_evaluate` reads at every task: were either renamed there, the replacement would do nothing, silently."""
    import types

    import lm_eval.evaluator
    import lm_eval.loggers.utils

    from trainer.evaluation import harness

    assert {"get_git_commit_hash", "add_env_info"} <= set(inspect.unwrap(lm_eval.evaluator.simple_evaluate).__code__.co_names)
    gathered = []

    def add_env_info(storage):  # lm-eval's own: torch's environment report, `pip list` included
        gathered.append(True)
        storage.update(pretty_env_info="the report", lm_eval_version="0.4")

    monkeypatch.setattr(lm_eval.loggers.utils, "add_env_info", add_env_info)
    harness._environment.cache_clear()
    evaluator = types.SimpleNamespace()
    harness._replace_helpers(evaluator)
    first, second = {"results": 1}, {"results": 2}
    evaluator.add_env_info(first)
    evaluator.add_env_info(second)
    assert first["pretty_env_info"] == second["pretty_env_info"] == "the report" and second["results"] == 2
    assert len(gathered) == 1 and evaluator.get_git_commit_hash() == "fulltune"
    harness._environment.cache_clear()


def test_the_models_attention_implementation_reads_back_from_its_config():
    """model/recipe.py, model/attention.py and evaluation/samples.py read `config._attn_implementation` (transformers has
    no public getter) to learn which attention a model runs, and set it with the public `set_attn_implementation`."""
    from transformers import PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

    assert isinstance(inspect.getattr_static(PretrainedConfig, "_attn_implementation"), property)
    net = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=8, max_position_embeddings=64))
    for name in ("eager", "sdpa"):
        net.set_attn_implementation(name)
        assert net.config._attn_implementation == name


def test_a_checkpoint_save_goes_through_the_jobs_background_path_and_never_through_transformers_own(demo_assets, tmp_path, monkeypatch):
    from transformers import Trainer

    from trainer import sft_trainer
    from trainer.core import config as job_config
    from trainer.core import settings as settings_table
    from trainer.data import prepare as data
    from trainer.model import loading, memory

    def transformers_own(*args, **kwargs):
        raise AssertionError("transformers' own _save_checkpoint ran: the job's background save was bypassed")

    monkeypatch.setattr(Trainer, "_save_checkpoint", transformers_own)
    rows = tmp_path / "rows.jsonl"
    from trainer.data import demo

    rows.write_text("".join(json.dumps(row) + "\n" for row in demo.conversations(16, seed=3)))
    out = tmp_path / "volume"
    env = {"FT_MODEL": str(demo_assets / "model"), "FT_DATASET": str(rows), "FT_OUTPUT_DIR": str(out), "FT_MAX_STEPS": "2", "FT_EVAL_STEPS": "1",
           "FT_SAVE_STEPS": "1", "FT_BATCH_SIZE": "2", "FT_GRADIENT_ACCUMULATION_STEPS": "1", "FT_MAX_LENGTH": "64", "FT_EVAL_FRACTION": "0.25",
           "FT_PLATFORM": "none", "FT_REGISTERED_MODEL": "", "FT_TERMINATION_MESSAGE_PATH": "", "FT_EVAL_SAMPLES": "0"}
    config = job_config.build(settings_table.load(env), cuda=False, bf16_supported=False)
    tokenizer = loading.load_tokenizer(config.settings)
    trainer = sft_trainer.build_trainer(config, tokenizer, data.prepare(config.settings, tokenizer), memory.preflight(config))
    trainer.train()
    (saver,) = [cb for cb in trainer.callback_handler.callbacks if hasattr(cb, "save_checkpoint")]
    saver.wait_for_saves()
    assert len(saver.costs.blocked) == 2  # both saves were the job's: it timed what each blocked training
    for step in (1, 2):
        assert (Path(out) / "checkpoints" / f"checkpoint-{step}" / "commit.json").exists()  # and committed them
