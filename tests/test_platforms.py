"""Platform detection: SageMaker, Vertex AI, AWS Batch and Azure ML variables fill in unset FT_* settings."""

import pytest

from trainer.core import platforms, settings


@pytest.fixture
def sagemaker_root(tmp_path, monkeypatch):
    """A stand-in for /opt/ml with CheckpointConfig set (SageMaker then creates /opt/ml/checkpoints)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "input" / "config").mkdir(parents=True)
    monkeypatch.setattr(platforms, "SAGEMAKER_ROOT", str(tmp_path))
    return tmp_path


@pytest.fixture(autouse=True)
def no_sagemaker_here(tmp_path_factory, monkeypatch):
    """Keep a real /opt/ml on the test machine from changing the results."""
    monkeypatch.setattr(platforms, "SAGEMAKER_ROOT", str(tmp_path_factory.mktemp("no-opt-ml") / "ml"))


def test_no_platform_variables_means_no_platform_and_no_values():
    assert platforms.detect({"HOME": "/tmp", "FT_MODEL": "x"}) == ("none", {})
    assert "no batch platform detected" in platforms.describe("none", {})


def test_sagemaker_checkpoint_folder_becomes_output_dir_and_channels_become_datasets(sagemaker_root):
    environ = {
        "SM_MODEL_DIR": "/opt/ml/model",
        "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train",
        "SM_CHANNEL_VALIDATION": "/opt/ml/input/data/validation",
    }
    name, implied = platforms.detect(environ)
    assert name == "sagemaker"
    assert implied == {
        "FT_OUTPUT_DIR": str(sagemaker_root / "checkpoints"),  # restored on restart, unlike SM_MODEL_DIR
        "FT_STOP_DEADLINE_SECONDS": "100",  # SageMaker kills 120 s after SIGTERM
        "FT_TERMINATION_MESSAGE_PATH": str(sagemaker_root / "output" / "failure"),
        "FT_DATASET": "/opt/ml/input/data/train",
        "FT_EVAL_DATASET": "/opt/ml/input/data/validation",
    }
    line = platforms.describe(name, implied)
    assert line.startswith("fulltune: platform sagemaker detected by SM_MODEL_DIR: ")
    assert "FT_DATASET=/opt/ml/input/data/train from SM_CHANNEL_TRAIN" in line


def test_sagemaker_without_checkpoint_config_writes_to_the_model_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(platforms, "SAGEMAKER_ROOT", str(tmp_path))  # no checkpoints/ folder
    name, implied = platforms.detect({"SM_MODEL_DIR": "/opt/ml/model"})
    assert (name, implied["FT_OUTPUT_DIR"]) == ("sagemaker", "/opt/ml/model")
    assert "FT_OUTPUT_DIR=/opt/ml/model from SM_MODEL_DIR" in platforms.describe(name, implied)


def test_sagemaker_is_found_from_its_files_when_the_toolkit_variables_are_absent(sagemaker_root):
    (sagemaker_root / "input" / "config" / "resourceconfig.json").write_text('{"current_host": "algo-1"}')
    (sagemaker_root / "input" / "data" / "train").mkdir(parents=True)
    (sagemaker_root / "input" / "data" / "model").mkdir(parents=True)
    name, implied = platforms.detect({"HOME": "/root"})
    assert name == "sagemaker"
    assert implied["FT_DATASET"] == str(sagemaker_root / "input" / "data" / "train")
    assert implied["FT_MODEL"] == str(sagemaker_root / "input" / "data" / "model")
    assert "FT_EVAL_DATASET" not in implied  # no validation channel


def test_vertex_gs_uris_become_cloud_storage_fuse_paths():
    environ = {
        "AIP_MODEL_DIR": "gs://my-bucket/fulltune/qwen3-4b/model/",
        "AIP_CHECKPOINT_DIR": "gs://my-bucket/fulltune/qwen3-4b/checkpoints/",
        "AIP_TRAINING_DATA_URI": "gs://my-bucket/data/training-*",
        "CLOUD_ML_JOB_ID": "123",
    }
    name, implied = platforms.detect(environ)
    assert name == "vertex"
    assert implied == {
        "FT_OUTPUT_DIR": "/gcs/my-bucket/fulltune/qwen3-4b/checkpoints",
        "FT_DATASET": "/gcs/my-bucket/data/training-*",
    }
    assert "FT_OUTPUT_DIR=/gcs/my-bucket/fulltune/qwen3-4b/checkpoints from AIP_CHECKPOINT_DIR" in platforms.describe(name, implied)


def test_vertex_without_a_checkpoint_dir_uses_the_model_dir():
    name, implied = platforms.detect({"AIP_MODEL_DIR": "gs://b/out/model/"})
    assert (name, implied) == ("vertex", {"FT_OUTPUT_DIR": "/gcs/b/out/model"})


def test_aws_batch_attempt_is_detected_and_logged_without_changing_settings():
    name, implied = platforms.detect({"AWS_BATCH_JOB_ID": "abc", "AWS_BATCH_JOB_ATTEMPT": "2"})
    assert (name, implied) == ("aws-batch", {})
    line = platforms.describe(name, implied)
    assert line == "fulltune: platform aws-batch detected by AWS_BATCH_JOB_ATTEMPT=2: no FT_* values implied"


def test_azureml_run_is_detected():
    name, implied = platforms.detect({"AZUREML_RUN_ID": "fulltune_1700000000_abc"})
    assert (name, implied) == ("azureml", {})
    assert "detected by AZUREML_RUN_ID" in platforms.describe(name, implied)


def test_explicit_ft_variables_win_over_the_platform_and_the_log_says_so(sagemaker_root):
    environ = {"TRAINING_JOB_ARN": "arn:aws:sagemaker:us-east-1:1:training-job/x", "FT_OUTPUT_DIR": "/mnt/mine"}
    name, implied = platforms.detect(environ)
    assert "FT_OUTPUT_DIR" not in implied
    assert "FT_OUTPUT_DIR set explicitly (kept)" in platforms.describe(name, implied)
    loaded = settings.load(environ)
    assert (loaded.output_dir, loaded.detected_platform) == ("/mnt/mine", "sagemaker")


def test_settings_take_the_platform_values_when_not_set(sagemaker_root):
    loaded = settings.load({"SM_MODEL_DIR": "/opt/ml/model", "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train"})
    assert loaded.detected_platform == "sagemaker"
    assert loaded.output_dir == str(sagemaker_root / "checkpoints")
    assert loaded.dataset == "/opt/ml/input/data/train"


def test_ft_platform_none_turns_detection_off(sagemaker_root):
    environ = {"FT_PLATFORM": "none", "SM_MODEL_DIR": "/opt/ml/model", "AWS_BATCH_JOB_ATTEMPT": "1"}
    assert platforms.detect(environ) == ("none", {})
    assert settings.load(environ).output_dir == "/output"


def test_ft_platform_forces_a_platform_whose_variables_are_missing():
    name, implied = platforms.detect({"FT_PLATFORM": "vertex"})
    assert (name, implied) == ("vertex", {})
    assert platforms.describe(name, implied) == "fulltune: platform vertex forced by FT_PLATFORM: no FT_* values implied"


def test_ft_platform_names_a_platform_and_the_first_match_wins_in_auto():
    environ = {"AIP_MODEL_DIR": "gs://b/m", "AWS_BATCH_JOB_ATTEMPT": "1"}
    assert platforms.detect(environ)[0] == "vertex"
    assert platforms.detect({**environ, "FT_PLATFORM": "aws-batch"}) == ("aws-batch", {})


def test_every_platform_in_the_settings_table_can_be_forced():
    choices = settings.BY_ENV_NAME["FT_PLATFORM"].kind
    assert set(choices) - {"auto", "none"} == set(platforms.PLATFORMS)


def test_the_platform_channel_wins_over_the_demo_preset(sagemaker_root):
    """SageMaker mounted the user's data: FT_PRESET=demo still trains on it (the preset only fills in what no one else set)."""
    job = {"TRAINING_JOB_ARN": "arn:aws:sagemaker:us-east-1:1:training-job/x", "FT_PRESET": "demo"}
    loaded = settings.load(job | {"SM_CHANNEL_TRAIN": "/opt/ml/input/data/train"})
    assert loaded.dataset == "/opt/ml/input/data/train"
    assert loaded.output_dir == str(sagemaker_root / "checkpoints")
    assert loaded.model == str(sagemaker_root / "checkpoints" / "demo" / "model")  # no model channel: the preset's
    assert loaded.stop_deadline_seconds == 100  # the platform's, the preset sets none
    assert settings.load(job | {"SM_CHANNEL_TRAIN": "/x", "FT_DATASET": "/mine.jsonl"}).dataset == "/mine.jsonl"
