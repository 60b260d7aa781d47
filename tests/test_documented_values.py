"""Every documented value of every setting runs: the job's own trainer, built in-process on the demo model,
trains 2 steps with it (or, for a value this machine cannot run, the documented error comes first).

A value that is documented but never run is how `FT_MAX_GRAD_NORM=0` ("no clipping") came to crash once
training started.  `test_every_setting_is_run_here_or_by_a_named_test` keeps the list complete: a new
setting must add its special values below, or name the test that runs them.
"""

from __future__ import annotations

import ast
import collections
import json
import math
from pathlib import Path

import pytest

from conftest import ROOT
from trainer import job, sft_trainer
from trainer.core import config as job_config
from trainer.core import settings as settings_table
from trainer.core.errors import ConfigError, DataError
from trainer.core.volume import Volume
from trainer.data import demo

STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A model this small gains nothing from a second thread and loses much on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def files(tmp_path_factory, demo_assets) -> dict[str, str]:
    """Tiny datasets, one per row format, plus one with a bad row and one for validation; the demo model with pickle weights."""
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("values-data")
    pickled = folder / "pickle-model"
    shutil.copytree(demo_assets / "model", pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(demo_assets / "model" / "model.safetensors"), pickled / "pytorch_model.bin")
    rows = demo.conversations(16, seed=3)

    def write(name: str, items: list) -> str:
        path = folder / name
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
        return str(path)

    def turns(row: dict) -> tuple[str, str]:
        return row["messages"][-2]["content"], row["messages"][-1]["content"]

    sharegpt = [{"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": a}]} for u, a in map(turns, rows)]
    bad = [*rows[:8], {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, *rows[8:]]
    custom = folder / "custom-code-model"  # a model type transformers does not have, defined by the code shipped with it
    shutil.copytree(demo_assets / "model", custom)
    config = json.loads((custom / "config.json").read_text())
    config |= {"model_type": "fulltune-custom", "architectures": ["CustomForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_custom.py").write_text("from transformers import Qwen3Config\n\n\n"
                                                    "class CustomConfig(Qwen3Config):\n    model_type = 'fulltune-custom'\n")
    (custom / "modeling_custom.py").write_text("from transformers import Qwen3ForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
                                               "class CustomForCausalLM(Qwen3ForCausalLM):\n    config_class = CustomConfig\n")
    return {
        "messages": write("messages.jsonl", rows),
        "sharegpt": write("sharegpt.jsonl", sharegpt),
        "prompt_completion": write("prompt_completion.jsonl", [{"prompt": u, "completion": a} for u, a in map(turns, rows)]),
        "text": write("text.jsonl", [{"text": f"{u} -> {a}"} for u, a in map(turns, rows)]),
        "alpaca": write("alpaca.jsonl", [{"instruction": u, "input": "", "output": a} for u, a in map(turns, rows)]),
        "with_bad_row": write("with_bad_row.jsonl", bad),
        "eval": write("eval.jsonl", demo.conversations(4, seed=4)),
        "pickle_model": str(pickled),
        "custom_code_model": str(custom),
    }


def base_env(demo_assets: Path, files: dict[str, str], output_dir: Path) -> dict[str, str]:
    return {
        "FT_MODEL": str(demo_assets / "model"),
        "FT_DATASET": files["messages"],
        "FT_OUTPUT_DIR": str(output_dir),
        "FT_MAX_STEPS": str(STEPS),
        "FT_EVAL_STEPS": str(STEPS),
        "FT_SAVE_STEPS": str(STEPS),
        "FT_LOGGING_STEPS": "1",
        "FT_WARMUP_STEPS": "1",
        "FT_BATCH_SIZE": "2",
        "FT_GRADIENT_ACCUMULATION_STEPS": "1",
        "FT_MAX_LENGTH": "64",
        "FT_EVAL_FRACTION": "0.25",
        "FT_PLATFORM": "none",
        "FT_REGISTERED_MODEL": "",
        "FT_TERMINATION_MESSAGE_PATH": "",
    }


def build(env: dict[str, str]):
    """The job's own path to its trainer, without MLflow: the configuration as entrypoint.py builds it, then
    `job.before_training` (every check, the plan, the tokenizer and the data, as `job.run` calls it) and `sft_trainer.build_trainer`."""
    config = job_config.build(settings_table.load(env), cuda=False, bf16_supported=False)
    _, plan, _, tokenizer, prepared = job.before_training(config, Volume(config.settings.output_dir))
    return sft_trainer.build_trainer(config, tokenizer, prepared, plan), prepared


# -- What each value must visibly do, besides training -------------------------------------------------


def no_evaluation(trainer, prepared, out, log):
    assert prepared.eval is None and not any("eval_loss" in entry for entry in trainer.state.log_history)
    assert (out / "checkpoints" / f"checkpoint-{STEPS}" / "commit.json").exists()


def evaluated_on(rows: int):
    def check(trainer, prepared, out, log):
        assert len(trainer.eval_dataset) == rows and any("eval_loss" in entry for entry in trainer.state.log_history)

    return check


def report(key: str, expected):
    def check(trainer, prepared, out, log):
        assert prepared.report[key] == expected, prepared.report[key]

    return check


def weights_unchanged(trainer, prepared, out, log):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(Path(trainer.model.name_or_path))
    for (name, before), after in zip(base.state_dict().items(), trainer.model.state_dict().values(), strict=True):
        assert after.equal(before.to(after.dtype)), name


def loaded_from_pickle(trainer, prepared, out, log):
    assert trainer.model.name_or_path.endswith("pickle-model") and (Path(trainer.model.name_or_path) / "pytorch_model.bin").exists()


def weights_changed(trainer, prepared, out, log):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(Path(trainer.model.name_or_path))
    assert not base.model.layers[0].mlp.up_proj.weight.equal(trainer.model.model.layers[0].mlp.up_proj.weight)


def recomputes(flags: list[bool]):
    def check(trainer, prepared, out, log):
        assert [layer.gradient_checkpointing for layer in trainer.model.model.layers] == flags

    return check


def arg(name: str, expected):
    def check(trainer, prepared, out, log):
        assert getattr(trainer.args, name) == expected, getattr(trainer.args, name)

    return check


def printed(*lines: str, absent: tuple[str, ...] = ()):
    def check(trainer, prepared, out, log):
        assert all(line in log for line in lines) and not any(line in log for line in absent), log

    return check


def runs_the_models_own_code(trainer, prepared, out, log):
    assert type(trainer.model).__name__ == "CustomForCausalLM" and type(trainer.model).__module__.endswith("modeling_custom")


def fp32_weights(trainer, prepared, out, log):
    import torch

    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32} and not trainer.args.bf16


def plain_adamw(trainer, prepared, out, log):
    import torch

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds torch's optimizer
    assert type(inner) is torch.optim.AdamW and not inner.defaults.get("fused")


def sequences(batch) -> int:
    """Sequences in one collated pass: rows, or (padding-free: one row) the starts of its position ids."""
    if "position_ids" in batch and batch["input_ids"].shape[0] == 1:
        return int((batch["position_ids"] == 0).sum())
    return batch["input_ids"].shape[0]


def passes_of(rows: int):
    def check(trainer, prepared, out, log):
        assert sequences(next(iter(trainer.get_train_dataloader()))) == rows

    return check


def padding_free(trainer, prepared, out, log):
    batch = next(iter(trainer.get_train_dataloader()))
    lengths = sorted(len(ids) for ids in prepared.train["input_ids"])
    assert batch["input_ids"].shape[0] == 1 and sequences(batch) == 2, batch["input_ids"].shape  # 2 rows, one row of tokens, no padding
    assert batch["input_ids"].shape[1] <= lengths[-1] + lengths[-2] and int((batch["input_ids"] == trainer.processing_class.pad_token_id).sum()) == 0


def one_evaluation_batch_of(rows: int):
    def check(trainer, prepared, out, log):
        batches = list(trainer.get_eval_dataloader())
        assert len(batches) == 1 and sequences(batches[0]) == rows

    return check


def learning_rates(fraction):
    """The schedule the trainer builds from these settings over 9 steps (1 of warm-up): each step's lr, as a fraction of the peak."""
    def check(trainer, prepared, out, log):
        trainer.lr_scheduler = None
        scheduler = trainer.create_scheduler(num_training_steps=9, optimizer=trainer.optimizer)
        rates = []
        for _ in range(9):
            rates.append(scheduler.get_last_lr()[0] / trainer.args.learning_rate)
            scheduler.step()
        assert rates == pytest.approx([0.0] + [fraction(step) for step in range(1, 9)], abs=1e-6), rates

    return check


def seeded(seed: int):
    def check(trainer, prepared, out, log):  # the Trainer seeds torch with it (shuffling, any fresh weights): 42 by default
        import torch

        assert torch.initial_seed() == seed

    return check


def skipped_one_bad_row(trainer, prepared, out, log):
    assert prepared.report["sources"]["train"]["bad_rows"] == 1 and len(prepared.train) + len(prepared.eval) == 16


def dropped_some(trainer, prepared, out, log):
    dropped = prepared.report["sources"]["train"]["dropped_too_long"]  # the validation rows are held out of the same file
    assert 0 < dropped < 16 and len(prepared.train) + len(prepared.eval) == 16 - dropped


def at_most(tokens: int):
    def check(trainer, prepared, out, log):
        assert max(len(ids) for ids in prepared.train["input_ids"]) == tokens and prepared.report["sources"]["train"]["truncated"] > 0

    return check


def cached(expected: bool):
    def check(trainer, prepared, out, log):
        assert (out / ".fulltune" / "data-cache").exists() == expected

    return check


def fused_adamw(trainer, prepared, out, log):
    assert trainer.optimizer.defaults.get("fused") is True


def bf16_weights(trainer, prepared, out, log):
    import torch

    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


def one_worker(trainer, prepared, out, log):
    assert trainer.get_train_dataloader().num_workers == 1


def demo_data(trainer, prepared, out, log):
    assert len(prepared.train) + len(prepared.eval) == 2000


def assistant_only(trainer, prepared, out, log):
    assert 0 < prepared.report["trained_token_fraction"] < 0.5


def padded(trainer, prepared, out, log):
    assert not getattr(trainer.data_collator, "padding_free", False)


def saves_at_evaluation_steps_by_cost(trainer, prepared, out, log):
    """FT_SAVE_STEPS=auto: the Trainer's own saves are moved past the last step (a multiple of FT_EVAL_STEPS), the job's saver
    decides at evaluation steps, and the last step saves."""
    assert trainer.args.save_steps == STEPS + 1 and trainer.saver.cadence.auto  # FT_EVAL_STEPS=1
    assert (out / "checkpoints" / f"checkpoint-{STEPS}" / "commit.json").exists()


def one_committed_checkpoint_plus_the_best(trainer, prepared, out, log):
    kept = sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*"))
    best = Path(trainer.state.best_model_checkpoint).name
    assert kept == sorted({f"checkpoint-{STEPS}", best}), kept


# (overrides, check): every value below runs 2 optimizer steps; the check then looks at what the value promises.
# `{messages}`-style values name the files fixture's datasets.
RUNS = {
    "defaults": ({}, evaluated_on(4)),
    "FT_PRESET=demo": ({"FT_PRESET": "demo", "FT_MODEL": None, "FT_DATASET": None, "FT_EVAL_MAX_SAMPLES": "4"}, demo_data),
    "FT_TRUST_REMOTE_CODE=true": ({"FT_TRUST_REMOTE_CODE": "true", "FT_MODEL": "{custom_code_model}"}, runs_the_models_own_code),
    "FT_ALLOW_PICKLE_WEIGHTS=true": ({"FT_ALLOW_PICKLE_WEIGHTS": "true", "FT_MODEL": "{pickle_model}"}, loaded_from_pickle),
    "FT_EVAL_DATASET=file": ({"FT_EVAL_DATASET": "{eval}"}, evaluated_on(4)),
    "FT_EVAL_FRACTION=0": ({"FT_EVAL_FRACTION": "0"}, no_evaluation),
    "FT_DATA_FORMAT=auto(sharegpt)": ({"FT_DATASET": "{sharegpt}"}, report("format", "sharegpt")),
    "FT_DATA_FORMAT=messages": ({"FT_DATA_FORMAT": "messages"}, report("format", "messages")),
    "FT_DATA_FORMAT=sharegpt": ({"FT_DATA_FORMAT": "sharegpt", "FT_DATASET": "{sharegpt}"}, report("format", "sharegpt")),
    "FT_DATA_FORMAT=prompt_completion": ({"FT_DATA_FORMAT": "prompt_completion", "FT_DATASET": "{prompt_completion}"}, report("format", "prompt_completion")),
    "FT_DATA_FORMAT=text": ({"FT_DATA_FORMAT": "text", "FT_DATASET": "{text}"}, report("format", "text")),
    "FT_DATA_FORMAT=alpaca": ({"FT_DATA_FORMAT": "alpaca", "FT_DATASET": "{alpaca}"}, report("format", "alpaca")),
    "FT_BAD_ROWS=skip": ({"FT_BAD_ROWS": "skip", "FT_DATASET": "{with_bad_row}"}, skipped_one_bad_row),
    "FT_LOSS_ON=assistant": ({"FT_LOSS_ON": "assistant"}, assistant_only),
    "FT_MAX_LENGTH=16": ({"FT_MAX_LENGTH": "16"}, at_most(16)),
    "FT_TRUNCATION=drop": ({"FT_TRUNCATION": "drop", "FT_MAX_LENGTH": "24"}, dropped_some),
    "FT_DATA_CACHE=true": ({"FT_DATA_CACHE": "true"}, cached(True)),
    "FT_DATA_CACHE=false": ({"FT_DATA_CACHE": "false"}, cached(False)),
    "FT_MAX_STEPS=1": ({"FT_MAX_STEPS": "1", "FT_EVAL_STEPS": "1", "FT_SAVE_STEPS": "1"}, None),
    "FT_LEARNING_RATE=0": ({"FT_LEARNING_RATE": "0"}, weights_unchanged),
    "FT_LR_SCHEDULER=linear": ({"FT_LR_SCHEDULER": "linear"}, learning_rates(lambda step: (9 - step) / 8)),
    "FT_LR_SCHEDULER=cosine": ({"FT_LR_SCHEDULER": "cosine"}, learning_rates(lambda step: 0.5 * (1 + math.cos(math.pi * (step - 1) / 8)))),
    "FT_LR_SCHEDULER=constant_with_warmup": ({"FT_LR_SCHEDULER": "constant_with_warmup"}, learning_rates(lambda step: 1.0)),
    "FT_WARMUP_STEPS=0": ({"FT_WARMUP_STEPS": "0"}, weights_changed),
    "FT_WEIGHT_DECAY=0": ({"FT_WEIGHT_DECAY": "0"}, weights_changed),
    "FT_MAX_GRAD_NORM=0": ({"FT_MAX_GRAD_NORM": "0"}, weights_changed),
    "FT_BATCH_SIZE=1": ({"FT_BATCH_SIZE": "1", "FT_GRADIENT_ACCUMULATION_STEPS": "1"}, passes_of(1)),
    "FT_SEED=0": ({"FT_SEED": "0"}, seeded(0)),
    "FT_EVAL_STEPS=1": ({"FT_EVAL_STEPS": "1", "FT_SAVE_STEPS": "1", "FT_EVAL_BATCH_SIZE": "1"}, evaluated_on(4)),
    "FT_EVAL_BATCH_SIZE=16": ({"FT_EVAL_BATCH_SIZE": "16", "FT_EVAL_FRACTION": "0.75"}, one_evaluation_batch_of(12)),
    "FT_SAVE_STEPS=auto": ({"FT_SAVE_STEPS": "auto", "FT_EVAL_STEPS": "1"}, saves_at_evaluation_steps_by_cost),
    "FT_SAVE_TOTAL_LIMIT=1": ({"FT_SAVE_TOTAL_LIMIT": "1", "FT_EVAL_STEPS": "1", "FT_SAVE_STEPS": "1"}, one_committed_checkpoint_plus_the_best),
    "FT_PRECISION=auto": ({"FT_PRECISION": "auto"}, fp32_weights),  # on a CPU: fp32
    "FT_PRECISION=fp32": ({"FT_PRECISION": "fp32"}, fp32_weights),
    "FT_PRECISION=bf16-sr": ({"FT_PRECISION": "bf16-sr"}, bf16_weights),
    "FT_ACTIVATION_CHECKPOINTING=auto": ({"FT_ACTIVATION_CHECKPOINTING": "auto"}, recomputes([False, False])),
    "FT_ACTIVATION_CHECKPOINTING=off": ({"FT_ACTIVATION_CHECKPOINTING": "off"}, recomputes([False, False])),
    "FT_ACTIVATION_CHECKPOINTING=full": ({"FT_ACTIVATION_CHECKPOINTING": "full"}, recomputes([True, True])),
    "FT_ACTIVATION_CHECKPOINTING=selective": ({"FT_ACTIVATION_CHECKPOINTING": "selective"}, recomputes([True, False])),
    "FT_BATCH_LAYOUT=auto": ({"FT_BATCH_LAYOUT": "auto", "FT_BATCH_SIZE": "1", "FT_GRADIENT_ACCUMULATION_STEPS": "2"}, arg("gradient_accumulation_steps", 1)),
    "FT_BATCH_LAYOUT=as-set": (
        {"FT_BATCH_LAYOUT": "as-set", "FT_BATCH_SIZE": "1", "FT_GRADIENT_ACCUMULATION_STEPS": "2"},
        arg("gradient_accumulation_steps", 2),
    ),
    "FT_PADDING_FREE=on": ({"FT_PADDING_FREE": "on"}, padding_free),
    "FT_PADDING_FREE=off": ({"FT_PADDING_FREE": "off"}, padded),
    "FT_OPTIMIZER=adamw_torch": ({"FT_OPTIMIZER": "adamw_torch"}, plain_adamw),
    "FT_OPTIMIZER=adamw_torch_fused": ({"FT_OPTIMIZER": "adamw_torch_fused"}, fused_adamw),
    "FT_EVAL_MAX_SAMPLES=1": ({"FT_EVAL_MAX_SAMPLES": "1"}, evaluated_on(1)),
    "FT_DATALOADER_WORKERS=1": ({"FT_DATALOADER_WORKERS": "1"}, one_worker),
    "FT_PREFLIGHT=warn": (
        {"FT_PREFLIGHT": "warn", "FT_GPU_MEMORY_GB": "0.001"},
        printed("fulltune: preflight warning: the estimated peak GPU memory does not fit"),
    ),
    "FT_PREFLIGHT=off": ({"FT_PREFLIGHT": "off", "FT_GPU_MEMORY_GB": "0.001"}, printed("fulltune: memory plan: ", absent=("preflight warning",))),
    "FT_GPU_MEMORY_GB=80": ({"FT_GPU_MEMORY_GB": "80"}, printed(" of 80.0 GB")),  # the plan is measured against 80 GB, not the CPU's none
}

# (overrides, error, message): values documented to stop before training on this machine.
REFUSED = {
    "FT_PRECISION=bf16-mixed": ({"FT_PRECISION": "bf16-mixed"}, ConfigError, r"FT_PRECISION=bf16-mixed needs a GPU with bf16 support"),
    "FT_LIGER=true": ({"FT_LIGER": "true"}, ConfigError, r"FT_LIGER=true needs a GPU"),
    "FT_PREFLIGHT=fail": (
        {"FT_PREFLIGHT": "fail", "FT_GPU_MEMORY_GB": "0.001"},
        ConfigError,
        r"preflight: the estimated peak GPU memory does not fit.*of 0\.0 GB",
    ),
    "FT_BAD_ROWS=fail": ({"FT_BAD_ROWS": "fail", "FT_DATASET": "{with_bad_row}"}, DataError, r"1 bad row\(s\); fix them or set FT_BAD_ROWS=skip"),
}

# Settings whose documented values are run by another test (a subprocess job, or no trainer involved).
ELSEWHERE = {
    # the evaluation stage runs after training, in the job process (tests/test_evaluation.py, test_learning's demo)
    "FT_EVAL_TASKS": "test_the_gate_keeps_a_model_that_got_worse_out_of_the_registry_with_exit_9_and_a_rerun_without_it_registers",
    "FT_EVAL_MAX_REGRESSION": "test_the_gate_keeps_a_model_that_got_worse_out_of_the_registry_with_exit_9_and_a_rerun_without_it_registers",
    "FT_EVAL_LIMIT": "test_a_stop_during_the_evaluation_exits_75_and_the_restart_evaluates_only_what_is_left_without_training",
    "FT_EVAL_ROWS": "test_the_next_job_on_the_same_base_reads_the_base_scores_and_scores_only_its_own_model",  # 0 = none
    "FT_EVAL_MAX_NEW_TOKENS": "test_the_demo_ends_with_a_before_after_table_where_the_fine_tuned_model_beats_the_base_on_both_scores",
    "FT_EVAL_CACHE_DIR": "test_the_next_job_on_the_same_base_reads_the_base_scores_and_scores_only_its_own_model",
    "FT_COMPILE": "test_compile_trains_on_cpu",
    "FT_MODEL_REVISION": "test_model_revision_loads_that_revision_of_a_hub_model_from_the_cache",  # a tag, a commit, and empty = main
    "FT_DATASET_CONFIG": "test_hub_id_passes_configuration_split_and_revision",  # "en", asked of the (stubbed) hub
    "FT_DATASET_REVISION": "test_hub_id_passes_configuration_split_and_revision",  # "a1b2c3"
    "FT_DATASET_SPLIT": "test_save_to_disk_folder_uses_the_named_split",
    "FT_OUTPUT_DIR": "test_runs_from_another_directory_with_a_relative_output_dir",
    "FT_REGISTERED_MODEL": "test_job_against_a_real_mlflow_server",  # ci.models.reverser there; empty = not registered here
    "FT_RUN_NAME": "test_job_against_a_real_mlflow_server",  # nightly-7 there; empty = <model>_full-fine-tuning in test_job.py
    "FT_SYSTEM_METRICS": "test_a_huge_learning_rate_exits_5_naming_the_step_and_the_last_good_checkpoint_and_a_retry_diverges_again",  # false there
    # 2 there (the demo's 0: FT_MAX_STEPS); FT_WARMUP_RATIO 0.1, the demo preset's, there too
    "FT_NUM_EPOCHS": "test_two_epochs_train_two_epochs_of_steps_and_a_stop_past_the_first_resumes_to_the_uninterrupted_weights",
    "FT_WARMUP_RATIO": "test_two_epochs_train_two_epochs_of_steps_and_a_stop_past_the_first_resumes_to_the_uninterrupted_weights",
    "FT_CHAT_TEMPLATE": "test_a_template_file_renders_the_rows_and_is_the_saved_models_template",  # empty everywhere else
    # 12 there; 0 (one try) in test_failed_registration_exits_3_keeps_the_model_and_a_retry_only_registers
    "FT_REGISTRATION_RETRY_SECONDS": "test_a_server_still_down_at_the_end_exits_3_keeping_the_model_and_the_metrics_and_a_retry_sends_them_and_registers",
    "FT_PLATFORM": "test_every_platform_in_the_settings_table_can_be_forced",
    "FT_STOP_DEADLINE_SECONDS": "test_a_stop_that_cannot_finish_in_time_exits_76",
    "FT_ALLOW_CONFIG_CHANGE": "test_allow_config_change_resumes_despite_a_changed_setting",
    "FT_TERMINATION_MESSAGE_PATH": "test_an_empty_termination_message_path_writes_nothing",
    # 4 there, 3 and 12 in tests/test_lease.py; 60 everywhere else
    "FT_LEASE_SECONDS": "test_a_lease_left_by_a_killed_job_is_taken_over_and_each_restart_resumes",
    "FT_SAVE_EVERY_MINUTES": "test_save_every_minutes_saves_at_the_first_evaluation_step_after_the_interval",  # 0 elsewhere
    "FT_LOG_LEVEL": "test_log_level_debug_shows_the_libraries_lines_and_a_run_shorter_than_the_logging_steps_prints_its_loss",  # info elsewhere
    "FT_DIVERGENCE_PATIENCE": "test_off_with_patience_0_and_a_limit_only_counts_when_set",
    "FT_LOSS_LIMIT": "test_a_loss_above_the_limit_stops_the_job_after_the_patience",
    "FT_NUM_PROCESSES": "test_two_processes_train_like_one_with_the_same_global_batch",  # 2; 0 (the default) everywhere else
    # ddp there; fsdp in test_fsdp_shards_the_model_over_two_cpu_processes_and_trains_what_one_process_trains
    "FT_DISTRIBUTED": "test_two_processes_train_like_one_with_the_same_global_batch",
    "FT_NUM_NODES": "test_two_nodes_train_one_model_in_one_run",  # filled in from PET_NNODES
    "FT_NODE_RANK": "test_two_nodes_train_one_model_in_one_run",
    "FT_MASTER_ADDR": "test_two_nodes_train_one_model_in_one_run",
    "FT_MASTER_PORT": "test_two_nodes_train_one_model_in_one_run",
    "FT_COLLECTIVE_TIMEOUT_SECONDS": "test_the_collective_timeout_is_what_the_process_groups_wait_for_a_silent_rank",  # 75
    "FT_EARLY_STOPPING_PATIENCE": "test_a_run_whose_eval_loss_rises_stops_early_with_exit_0_and_the_best_checkpoint_as_final_model",
    "FT_EVAL_SAMPLES": "test_the_same_validation_prompts_are_answered_at_step_0_and_at_each_evaluation",
    "FT_EVAL_SAMPLE_TOKENS": "test_each_answer_is_what_transformers_generates_greedily_from_that_steps_weights",
    "FT_METRICS_PORT": "test_metrics_show_the_step_rising_tokens_per_s_and_the_time_since_the_last_step_resetting",  # a free port; 0 elsewhere
    # 3 (and 0: never) there, with FT_STUCK_EXIT false and true; 1800 elsewhere
    "FT_STUCK_AFTER_SECONDS": "test_a_hung_job_is_flagged_stuck_once_and_with_stuck_exit_ends_77_saving_nothing",
    "FT_STUCK_EXIT": "test_a_hung_job_is_flagged_stuck_once_and_with_stuck_exit_ends_77_saving_nothing",
    "FT_MIRROR_URL": "test_the_demo_reads_s3_data_and_the_bucket_holds_each_committed_checkpoint_with_its_manifest_and_the_final_model",  # empty elsewhere
    "FT_MIRROR_WAIT_SECONDS": "test_the_bucket_down_past_the_end_exits_8_keeping_the_model_and_a_retry_only_uploads",  # 3 there, 600 elsewhere
    "FT_PUSH_TO_HUB": "test_a_hub_that_does_not_answer_exits_8_keeping_the_model_and_its_card_and_a_retry_only_pushes",  # empty elsewhere
    # true there; no push reaches a hub in the tests (none is reachable), so what false changes is not run anywhere
    "FT_HUB_PRIVATE": "test_a_hub_that_does_not_answer_exits_8_keeping_the_model_and_its_card_and_a_retry_only_pushes",
    "FT_RENDEZVOUS_TIMEOUT_SECONDS": "test_a_node_whose_peers_never_come_waits_the_rendezvous_timeout_then_exits_1_naming_it",  # 10 there, 1800 elsewhere
}


def resolve(overrides: dict[str, str | None], files: dict[str, str]) -> dict[str, str | None]:
    return {k: v.format(**files) if isinstance(v, str) else v for k, v in overrides.items()}


def env_for(overrides, demo_assets, files, out) -> dict[str, str]:
    env = base_env(demo_assets, files, out) | resolve(overrides, files)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize("name", list(RUNS))
def test_each_documented_value_trains(name, demo_assets, files, tmp_path, capsys):
    overrides, check = RUNS[name]
    out = tmp_path / "volume"
    if overrides.get("FT_PRESET") == "demo":
        out.mkdir()
        (out / "demo").symlink_to(demo_assets)  # the preset's folder, already built
    trainer, prepared = build(env_for(overrides, demo_assets, files, out))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == int(overrides.get("FT_MAX_STEPS", STEPS))
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    if check:
        check(trainer, prepared, out, capsys.readouterr().out)


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_value_this_machine_cannot_run_is_refused_with_the_documented_error(name, demo_assets, files, tmp_path):
    overrides, error, message = REFUSED[name]
    with pytest.raises(error, match=message):
        build(env_for(overrides, demo_assets, files, tmp_path / "volume"))
    assert not (tmp_path / "volume" / "checkpoints").exists()


def test_every_setting_is_run_here_or_by_a_named_test():
    named_here = {key.split("=")[0] for key in (*RUNS, *REFUSED) if key.startswith("FT_")}
    named_here |= set(base_env(Path("model"), collections.defaultdict(str), Path("volume")))  # run by "defaults"
    missing = set(settings_table.BY_ENV_NAME) - named_here - set(ELSEWHERE)
    assert not missing, f"add their documented values to RUNS or REFUSED, or name the test that runs them in ELSEWHERE: {sorted(missing)}"
    tests = {node.name for path in (ROOT / "tests").glob("test_*.py") for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    assert not {test for test in ELSEWHERE.values() if test not in tests}
    for env_name, setting in settings_table.BY_ENV_NAME.items():  # every choice of a choice setting is run or refused
        if isinstance(setting.kind, tuple) and env_name not in ELSEWHERE:
            assert {f"{env_name}={choice}" for choice in setting.kind} - set(RUNS) - set(REFUSED) <= {f"{env_name}={setting.default}"}, env_name
        if setting.words and env_name not in ELSEWHERE:  # so is every word a number's setting takes (FT_SAVE_STEPS=auto)
            assert {f"{env_name}={word}" for word in setting.words} <= set(RUNS) | set(REFUSED), env_name


def test_allow_config_change_resumes_despite_a_changed_setting(demo_assets, files, tmp_path):
    env = base_env(demo_assets, files, tmp_path / "volume")
    job_config.check_fingerprint(job_config.build(settings_table.load(env), cuda=False, bf16_supported=False))
    changed = env | {"FT_LEARNING_RATE": "0.5"}
    with pytest.raises(ConfigError, match=r"FT_LEARNING_RATE: '2e-05' on the volume, '0.5' now.*FT_ALLOW_CONFIG_CHANGE=true"):
        job_config.check_fingerprint(job_config.build(settings_table.load(changed), cuda=False, bf16_supported=False))
    job_config.check_fingerprint(job_config.build(settings_table.load(changed | {"FT_ALLOW_CONFIG_CHANGE": "true"}), cuda=False, bf16_supported=False))
    assert json.loads((tmp_path / "volume" / ".fulltune" / "fingerprint.json").read_text())["FT_LEARNING_RATE"] == "0.5"


def test_an_empty_termination_message_path_writes_nothing(tmp_path, monkeypatch):
    from trainer.core import ending

    monkeypatch.chdir(tmp_path)
    job_config.build(settings_table.load({"FT_PLATFORM": "none", "FT_TERMINATION_MESSAGE_PATH": ""}), cuda=False, bf16_supported=False)
    assert ending.termination_message_path() is None
    ending.write_termination_message("exit 2: nothing")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_compile_trains_on_cpu(demo_assets, files, tmp_path):
    """FT_COMPILE=true is meant for the GPU, but it also runs here: 1 step, no evaluation, so one graph compiles."""
    overrides = {"FT_COMPILE": "true", "FT_MAX_STEPS": "1", "FT_EVAL_STEPS": "1", "FT_SAVE_STEPS": "1", "FT_EVAL_FRACTION": "0"}
    trainer, _ = build(env_for(overrides, demo_assets, files, tmp_path / "volume"))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 1 and losses and math.isfinite(losses[0])
