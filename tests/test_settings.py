"""The FT_* contract: names, validation, presets, and the documentation generated from them."""

from __future__ import annotations

import re
import time

import pytest

from conftest import ROOT, job_env, run_job, termination_message
from trainer.core import config, errors, fields, refusals, schedule, settings, settings_doc
from trainer.core.errors import ConfigError

# The public names. Removing or renaming one breaks users' manifests: change this set on purpose only.
PUBLIC_NAMES = {
    "FT_EVAL_ROWS", "FT_EVAL_MAX_NEW_TOKENS", "FT_EVAL_TASKS", "FT_EVAL_LIMIT", "FT_EVAL_MAX_REGRESSION", "FT_EVAL_CACHE_DIR",
    "FT_PRESET", "FT_MODEL", "FT_MODEL_REVISION", "FT_TRUST_REMOTE_CODE", "FT_DATASET", "FT_DATASET_CONFIG",
    "FT_DATASET_SPLIT", "FT_DATASET_REVISION", "FT_EVAL_DATASET", "FT_EVAL_FRACTION", "FT_DATA_FORMAT", "FT_BAD_ROWS",
    "FT_LOSS_ON", "FT_MAX_LENGTH", "FT_TRUNCATION", "FT_MAX_STEPS", "FT_LEARNING_RATE", "FT_LR_SCHEDULER",
    "FT_WARMUP_STEPS", "FT_WEIGHT_DECAY", "FT_MAX_GRAD_NORM", "FT_BATCH_SIZE", "FT_GRADIENT_ACCUMULATION_STEPS",
    "FT_SEED", "FT_EVAL_STEPS", "FT_EVAL_BATCH_SIZE", "FT_SAVE_STEPS", "FT_SAVE_EVERY_MINUTES", "FT_SAVE_TOTAL_LIMIT", "FT_LOGGING_STEPS",
    "FT_OUTPUT_DIR", "FT_PRECISION", "FT_ACTIVATION_CHECKPOINTING", "FT_REGISTERED_MODEL", "FT_RUN_NAME",
    "FT_SYSTEM_METRICS", "FT_REGISTRATION_RETRY_SECONDS", "FT_PLATFORM", "FT_STOP_DEADLINE_SECONDS", "FT_ALLOW_CONFIG_CHANGE",
    "FT_TERMINATION_MESSAGE_PATH", "FT_LEASE_SECONDS", "FT_DATA_CACHE", "FT_BATCH_LAYOUT", "FT_PADDING_FREE", "FT_OPTIMIZER", "FT_COMPILE",
    "FT_LIGER", "FT_EVAL_MAX_SAMPLES", "FT_DATALOADER_WORKERS", "FT_PREFLIGHT", "FT_GPU_MEMORY_GB", "FT_DIVERGENCE_PATIENCE",
    "FT_LOSS_LIMIT", "FT_ALLOW_PICKLE_WEIGHTS",
    "FT_NUM_PROCESSES", "FT_DISTRIBUTED", "FT_NUM_NODES", "FT_NODE_RANK", "FT_MASTER_ADDR", "FT_MASTER_PORT",
    "FT_COLLECTIVE_TIMEOUT_SECONDS", "FT_RENDEZVOUS_TIMEOUT_SECONDS", "FT_EARLY_STOPPING_PATIENCE", "FT_EVAL_SAMPLES",
    "FT_EVAL_SAMPLE_TOKENS", "FT_LOG_LEVEL", "FT_METRICS_PORT", "FT_STUCK_AFTER_SECONDS", "FT_STUCK_EXIT",
    "FT_MIRROR_URL", "FT_MIRROR_WAIT_SECONDS", "FT_PUSH_TO_HUB", "FT_HUB_PRIVATE",
    "FT_NUM_EPOCHS", "FT_WARMUP_RATIO", "FT_CHAT_TEMPLATE",
}


def test_the_set_of_public_setting_names_is_pinned():
    assert set(settings.BY_ENV_NAME) == PUBLIC_NAMES


def test_defaults_are_the_reference_recipe():
    config = settings.load({"FT_PLATFORM": "none"})
    assert (config.model, config.dataset, config.output_dir) == ("Qwen/Qwen3-4B", "trl-lib/Capybara", "/output")
    assert (config.batch_size, config.gradient_accumulation_steps, config.learning_rate, config.max_steps) == (1, 8, 2e-5, 50)
    assert (config.warmup_steps, config.weight_decay, config.eval_steps, config.save_steps) == (10, 0.01, 25, 25)
    assert (config.logging_steps, config.save_total_limit, config.eval_fraction, config.seed) == (10, 2, 0.1, 42)
    assert config.registered_model == "main.default.qwen3_4b_assistant"
    assert config.trust_remote_code is False


@pytest.mark.faults("several bad settings at once")
def test_bad_values_exit_2_within_seconds_naming_every_variable(tmp_path):
    env = job_env(tmp_path / "volume", FT_LEARNING_RATE="fast", FT_MAX_STEPS="-3", FT_BATCH_SIZE="0")
    started = time.monotonic()
    result = run_job(env, timeout=60)
    assert time.monotonic() - started < 10
    assert result.returncode == 2
    for expected in ("FT_LEARNING_RATE='fast'", "FT_MAX_STEPS='-3'", "FT_BATCH_SIZE='0'", "allowed: an integer >= 1"):
        assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert "FT_LEARNING_RATE" in termination_message(env)
    assert not (tmp_path / "volume").exists(), "nothing is written before the settings are valid"


@pytest.mark.faults("a misspelt FT_ variable")
def test_an_unknown_ft_variable_is_rejected_and_a_secret_looking_value_is_masked():
    with pytest.raises(ConfigError, match=r"FT_LEARNIN_RATE='1e-4': is not a fulltune setting") as caught:
        settings.load({"FT_LEARNIN_RATE": "1e-4", "FT_API_TOKEN": "hunter2"})
    assert "FT_API_TOKEN=****" in str(caught.value) and "hunter2" not in str(caught.value)


SECRETS = ("HF_TOKEN", "FT_API_TOKEN", "MLFLOW_TRACKING_TOKEN", "DATABRICKS_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY",
           "AZURE_CLIENT_SECRET", "OPENAI_API_KEY", "FT_APIKEY", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_CONNECTION_STRING", "FT_TOKEN_SECRET")
NOT_SECRETS = ("FT_EVAL_SAMPLE_TOKENS", "FT_MAX_TOKENS", "FT_TOKENIZER", "FT_MAX_LENGTH", "FT_MODEL")


def test_secret_named_variables_are_masked_and_settings_that_count_tokens_are_not():
    assert [name for name in SECRETS if refusals.shown(name, "v") != "****"] == []
    assert [name for name in NOT_SECRETS if refusals.shown(name, "16") != "'16'"] == []
    with pytest.raises(ConfigError) as caught:
        settings.load({"FT_PLATFORM": "none", "FT_EVAL_SAMPLE_TOKENS": "0"})
    assert "FT_EVAL_SAMPLE_TOKENS='0': out of range" in str(caught.value)  # the refused value is shown: it is a count, not a token


@pytest.mark.faults("an invalid value and a rule across two settings broken, together")
def test_a_rule_across_two_settings_is_reported_with_the_invalid_values_in_one_error():
    with pytest.raises(ConfigError) as caught:
        settings.load({"FT_PLATFORM": "none", "FT_MAX_STEPS": "many", "FT_SAVE_STEPS": "30", "FT_EVAL_FRACTION": "1.5"})
    message = str(caught.value)
    assert message.startswith("3 invalid setting(s)")
    assert "FT_MAX_STEPS='many'" in message and "FT_SAVE_STEPS='30': must be a multiple of FT_EVAL_STEPS=25" in message
    assert "FT_EVAL_FRACTION='1.5': must be >= 0 and < 1" in message
    with pytest.raises(ConfigError) as caught:  # a rule whose other setting is itself invalid waits for it: no second-hand complaint
        settings.load({"FT_PLATFORM": "none", "FT_EVAL_STEPS": "often", "FT_SAVE_STEPS": "30"})
    assert str(caught.value).startswith("1 invalid setting(s)") and "FT_EVAL_STEPS='often'" in str(caught.value)


@pytest.mark.faults
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FT_PRECISION": "fp16"}, r"FT_PRECISION='fp16': not a valid choice \(allowed: one of auto, fp32, bf16-mixed, bf16-sr\)"),
        ({"FT_TRUST_REMOTE_CODE": "maybe"}, r"FT_TRUST_REMOTE_CODE='maybe': Not a valid boolean"),
        ({"FT_SAVE_STEPS": "30"}, r"FT_SAVE_STEPS='30': must be a multiple of FT_EVAL_STEPS=25"),
        ({"FT_EVAL_FRACTION": "1.5"}, r"FT_EVAL_FRACTION='1.5': must be >= 0 and < 1"),
        ({"FT_REGISTERED_MODEL": "a.b.c.d"}, r"FT_REGISTERED_MODEL='a.b.c.d': must be `model` or `catalog.schema.model`"),
        ({"FT_METRICS_PORT": "29500"}, r"FT_METRICS_PORT='29500': must differ from FT_MASTER_PORT=29500, where node 0 holds the processes' rendezvous"),
        ({"FT_METRICS_PORT": "65536"}, r"FT_METRICS_PORT='65536': out of range \(allowed: an integer >= 0 and <= 65535\)"),
        ({"FT_MIRROR_URL": "/mnt/backup"}, r"FT_MIRROR_URL='/mnt/backup': must be an object-store folder: s3://bucket/path"),
        ({"FT_PUSH_TO_HUB": "my-model"}, r"FT_PUSH_TO_HUB='my-model': must be a hub repository id, `org/name`"),
    ],
)
def test_invalid_setting_is_named_with_what_is_allowed(env, message):
    with pytest.raises(ConfigError, match=message):
        settings.load(env | {"FT_PLATFORM": "none"})


@pytest.mark.faults
@pytest.mark.parametrize(("variable", "url"), [("FT_MIRROR_URL", "s3://AKIAEXAMPLE:pw-in-url-0123@bucket/run1"),
                                              ("FT_DATASET", "az://data/train.jsonl?sv=2024&sig=pw-in-url-0123")])
def test_an_object_store_url_holding_a_credential_exits_2_without_showing_it(variable, url):
    """The URL settings reach the log, the MLflow params and the run report: a credential in one is refused, and the refusal masks it."""
    with pytest.raises(ConfigError, match=rf"{variable}='(s3|az)://\S*\*\*\*\*\S*': must not hold a (credential|query string)") as caught:
        settings.load({variable: url, "FT_PLATFORM": "none"})
    assert "pw-in-url" not in str(caught.value)


def test_explicit_variables_override_the_demo_preset():
    config = settings.load({"FT_PRESET": "demo", "FT_OUTPUT_DIR": "/v", "FT_MAX_STEPS": "7", "FT_PLATFORM": "none"})
    assert config.max_steps == 7
    assert config.model == "/v/demo/model" and config.learning_rate == 1e-3


@pytest.mark.parametrize(
    ("env", "epochs", "steps", "ratio", "warmup"),
    [
        ({}, 0.0, 50, 0.0, 10),  # the reference recipe: FT_MAX_STEPS, FT_WARMUP_STEPS
        ({"FT_NUM_EPOCHS": "3", "FT_WARMUP_RATIO": "0.1"}, 3.0, 50, 0.1, 10),  # explicit beats the defaults
        ({"FT_NUM_EPOCHS": "3", "FT_MAX_STEPS": "30", "FT_WARMUP_RATIO": "0.1", "FT_WARMUP_STEPS": "2"}, 0.0, 30, 0.0, 2),  # both explicit: steps
        ({"FT_PRESET": "demo", "FT_NUM_EPOCHS": "2"}, 2.0, None, 0.1, None),  # explicit epochs beat the preset's steps; its ratio stays
        ({"FT_PRESET": "demo", "FT_MAX_STEPS": "7", "FT_WARMUP_STEPS": "1"}, 0.0, 7, 0.0, 1),  # explicit steps beat the preset's ratio
    ],
)
def test_epochs_and_a_warmup_ratio_win_over_step_counts_set_less_explicitly_and_give_way_to_ones_set_as_explicitly(env, epochs, steps, ratio, warmup):
    loaded = settings.load(env | {"FT_PLATFORM": "none", "FT_OUTPUT_DIR": "/v"})
    assert loaded.num_epochs == epochs and loaded.warmup_ratio == ratio
    assert steps is None or loaded.max_steps == steps
    assert warmup is None or loaded.warmup_steps == warmup


def test_the_schedule_counts_an_epoch_as_the_trainer_does_and_the_warmup_ratio_of_its_steps():
    by_epochs = settings.load({"FT_PLATFORM": "none", "FT_NUM_EPOCHS": "2", "FT_BATCH_SIZE": "16", "FT_GRADIENT_ACCUMULATION_STEPS": "4",
                               "FT_WARMUP_RATIO": "0.1"})
    steps = schedule.of(by_epochs, train_rows=1800)  # 28 full steps of 64 sequences, then one of 8
    assert (steps.steps_per_epoch, steps.steps, steps.warmup_steps, steps.epochs) == (29, 58, 6, 2.0)
    assert schedule.of(by_epochs, train_rows=1800, processes=2).steps == 2 * 15  # 128 sequences a step across two processes
    assert schedule.of(by_epochs, train_rows=10).steps == 2  # fewer rows than a step: one step an epoch
    half = settings.load({"FT_PLATFORM": "none", "FT_NUM_EPOCHS": "0.5", "FT_BATCH_SIZE": "64", "FT_GRADIENT_ACCUMULATION_STEPS": "1"})
    assert schedule.of(half, train_rows=1800).steps == 15  # ceil(14.5), as transformers rounds
    by_steps = schedule.of(settings.load({"FT_PLATFORM": "none", "FT_MAX_STEPS": "40"}), train_rows=1800)
    assert (by_steps.steps, by_steps.warmup_steps, by_steps.by_epochs) == (40, 10, False)


@pytest.mark.faults
def test_a_warmup_ratio_of_one_or_more_exits_2():
    with pytest.raises(ConfigError, match=r"FT_WARMUP_RATIO='1': must be >= 0 and < 1"):
        settings.load({"FT_PLATFORM": "none", "FT_WARMUP_RATIO": "1"})


def test_params_for_mlflow_are_the_effective_ft_values():
    params = settings.as_params(settings.load({"FT_MAX_STEPS": "9", "FT_PLATFORM": "none"}))
    assert params["FT_MAX_STEPS"] == "9"
    assert set(params) - {"detected_platform"} == set(settings.BY_ENV_NAME)


def test_the_documented_tables_match_the_code():
    regenerate = "run `python -m trainer.core.settings_doc` to regenerate them"
    assert settings_doc.settings_table() in (ROOT / "docs" / "settings.md").read_text(), regenerate
    assert settings_doc.exit_code_summary() in (ROOT / "README.md").read_text(), regenerate
    failures = (ROOT / "docs" / "preemption-and-failures.md").read_text()
    assert settings_doc.exit_code_table() in failures, regenerate
    assert set(errors.EXIT_SUMMARY) == set(errors.EXIT_CODES)  # every code in both tables, each README row linking to its anchor


def test_every_error_class_has_a_documented_exit_code():
    """Every class, however deep (SmallestPlanOutOfMemory is OutOfMemory's), and every documented code is some class's."""

    def family(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in family(sub))]

    classes = family(errors.FulltuneError)
    assert errors.SmallestPlanOutOfMemory in classes and errors.RegressionFound in classes
    undocumented = [cls.__name__ for cls in classes if cls.exit_code not in errors.EXIT_CODES]
    assert undocumented == []
    assert set(errors.EXIT_CODES) - {cls.exit_code for cls in classes} == {0}  # no code documented that nothing raises (0: success)


def test_every_setting_has_help_a_type_and_a_group():
    for s in settings.TABLE:
        assert s.help and s.group and re.fullmatch(r"[a-z0-9_]+", s.name) and s.changes in fields.CHANGES, s


def test_the_first_line_names_the_detected_platform_and_what_it_filled_in(tmp_path):
    env = job_env(tmp_path / "volume", FT_MAX_STEPS="0", AIP_MODEL_DIR="gs://bucket/model")
    del env["FT_OUTPUT_DIR"]
    result = run_job(env, timeout=60)
    assert result.returncode == 2
    assert result.stdout.splitlines()[0] == "fulltune: platform vertex detected by AIP_MODEL_DIR: FT_OUTPUT_DIR=/gcs/bucket/model from AIP_MODEL_DIR"


@pytest.mark.parametrize(
    ("model", "registered", "run"),
    [
        ("Qwen/Qwen3-4B", "main.default.qwen3_4b_assistant", "Qwen3-4B_full-fine-tuning"),  # the seed's model keeps the seed's name
        ("Qwen/Qwen3-0.6B", "main.default.qwen3_0_6b_sft", "Qwen3-0.6B_full-fine-tuning"),
        ("/models/Llama-3.2-1B/", "main.default.llama_3_2_1b_sft", "Llama-3.2-1B_full-fine-tuning"),
        ("/out/run1/final/model", "main.default.run1_sft", "run1_full-fine-tuning"),  # a finished job's model: named after its volume
        ("/hf/hub/models--org--Tiny-Chat/snapshots/" + "a" * 40, "main.default.tiny_chat_sft", "Tiny-Chat_full-fine-tuning"),
    ],
)
def test_the_default_registered_and_run_names_come_from_the_model(model, registered, run):
    loaded = settings.load({"FT_MODEL": model})
    assert loaded.registered_model == registered
    assert config.build(loaded, cuda=False, bf16_supported=False).run_name == run


def test_an_explicit_or_empty_registered_name_is_kept_and_still_validated():
    assert settings.load({"FT_MODEL": "Qwen/Qwen3-0.6B", "FT_REGISTERED_MODEL": "main.ml.mine"}).registered_model == "main.ml.mine"
    assert settings.load({"FT_MODEL": "Qwen/Qwen3-0.6B", "FT_REGISTERED_MODEL": ""}).registered_model == ""  # empty: do not register
    assert settings.load({"FT_PRESET": "demo"}).registered_model == "demo.default.tiny_qwen3_assistant"
    with pytest.raises(ConfigError, match="FT_REGISTERED_MODEL='a b': must be `model` or `catalog.schema.model`"):
        settings.load({"FT_MODEL": "Qwen/Qwen3-0.6B", "FT_REGISTERED_MODEL": "a b"})


def test_a_typo_is_answered_with_the_setting_it_most_likely_meant():
    with pytest.raises(ConfigError, match=r"FT_LEARNIN_RATE='1e-4': is not a fulltune setting; did you mean FT_LEARNING_RATE\?"):
        settings.load({"FT_LEARNIN_RATE": "1e-4"})
    with pytest.raises(ConfigError, match=r"FT_BOGUS='1': is not a fulltune setting \(docs/settings.md lists them\)"):
        settings.load({"FT_BOGUS": "1"})


def test_a_lowercase_setting_exits_2_naming_the_right_spelling_instead_of_being_ignored():
    with pytest.raises(ConfigError, match=r"ft_max_steps='3': is not a fulltune setting: variable names are case-sensitive; did you mean FT_MAX_STEPS\?"):
        settings.load({"ft_max_steps": "3"})
