"""The batch-service specs in deploy/, checked with each provider's own models: botocore's service models
(AWS Batch, SageMaker), the aiplatform_v1 protobuf messages (Vertex AI) and azure-ai-ml's job schema."""

import json
import re
import string
import subprocess

import botocore.session
import pytest
import yaml
from botocore.validate import validate_parameters
from deploy_files import REPO, validators_python
from google.cloud import aiplatform_v1

from trainer.core import platforms, settings

DEPLOY = REPO / "deploy"
# What docs/deployment.md's `envsubst` fills in; the raw files (with ${...} left in) must validate too.
PLACEHOLDERS = {
    "AWS_ACCOUNT_ID": "123456789012",
    "AWS_REGION": "us-east-1",
    "S3_BUCKET": "my-bucket",
    "JOB_NAME": "fulltune-qwen3-4b-20260101",
    "EFS_FILE_SYSTEM_ID": "fs-0123456789abcdef0",
    "EFS_ACCESS_POINT_ID": "fsap-0123456789abcdef0",
    "IMAGE": "us-docker.pkg.dev/my-project/ml/fulltune:0.1.0",
    "BUCKET": "my-bucket",
}


def _texts(path):
    raw = path.read_text()
    filled = string.Template(raw).substitute(PLACEHOLDERS)  # KeyError on a placeholder the guide does not set
    return {"raw": raw, "filled": filled}


def _validate_aws(service, operation, path):
    shape = botocore.session.get_session().get_service_model(service).operation_model(operation).input_shape
    documents = {name: json.loads(text) for name, text in _texts(path).items()}
    for document in documents.values():
        validate_parameters(document, shape)  # raises ParamValidationError naming the bad field
    return documents["filled"], shape


def _assert_known_settings(env):
    unknown = [name for name in env if name.startswith("FT_") and name not in settings.BY_ENV_NAME]
    assert unknown == [], "unknown FT_* variables exit 2"
    settings.load({**env, "FT_PLATFORM": "none"})  # raises ConfigError on a bad value


def _batch_action(retry: dict, exit_code: int | None, status_reason: str = "") -> str:
    """What AWS Batch does after an attempt: the first rule whose every condition matches (a trailing `*` matches any
    rest), RETRY when none does (the service's documented default)."""

    def matches(pattern: str | None, value: str | None) -> bool:
        if pattern is None:
            return True
        if value is None:
            return False
        return value.startswith(pattern[:-1]) if pattern.endswith("*") else value == pattern

    for rule in retry["evaluateOnExit"]:
        if (
            matches(rule.get("onExitCode"), None if exit_code is None else str(exit_code))
            and matches(rule.get("onStatusReason"), status_reason)
            and matches(rule.get("onReason"), "")
        ):
            return rule["action"]
    return "RETRY"


def test_aws_batch_job_definition_validates_and_retries_by_exit_code():
    spec, _ = _validate_aws("batch", "RegisterJobDefinition", DEPLOY / "aws-batch" / "job-definition.json")
    retry = spec["retryStrategy"]
    for code in (2, 4, 5, 6, 9):  # bad configuration, out of GPU memory, diverged, volume full, a benchmark fell: a retry cannot help
        assert _batch_action(retry, code) == "EXIT", code
    for code in (1, 3, 7, 75, 76, 77, 137, 143):  # unexpected, registration only, volume leased by another job, stopped, stuck, killed (OOMKilled, SIGTERM)
        assert _batch_action(retry, code) == "RETRY", code
    assert _batch_action(retry, None, "Host EC2 (instance i-0abc) terminated.") == "RETRY"  # Spot reclaim
    assert len(retry["evaluateOnExit"]) <= 5  # the service's limit
    assert retry["attempts"] >= 3  # Batch counts every attempt, resumed ones included
    container = spec["containerProperties"]
    assert {"type": "GPU", "value": "1"} in container["resourceRequirements"]
    assert container["readonlyRootFilesystem"] is True and container["user"] == "10001"
    env = {e["name"]: e["value"] for e in container["environment"]}
    mounts = {m["containerPath"] for m in container["mountPoints"]}
    assert {env["FT_OUTPUT_DIR"], "/tmp"} <= mounts  # writable places on a read-only root
    _assert_known_settings(env)


def test_sagemaker_training_job_validates_and_checkpoints_where_detection_looks():
    spec, shape = _validate_aws("sagemaker", "CreateTrainingJob", DEPLOY / "sagemaker" / "training-job.json")
    instance_types = shape.members["ResourceConfig"].members["InstanceType"].enum
    assert spec["ResourceConfig"]["InstanceType"] in instance_types and spec["ResourceConfig"]["InstanceType"].startswith("ml.p5.")
    assert spec["CheckpointConfig"]["LocalPath"] == platforms.SAGEMAKER_ROOT + "/checkpoints"  # becomes FT_OUTPUT_DIR
    if spec.get("EnableManagedSpotTraining"):
        assert spec["StoppingCondition"]["MaxWaitTimeInSeconds"] >= spec["StoppingCondition"]["MaxRuntimeInSeconds"]
    env = spec["Environment"]
    assert "FT_OUTPUT_DIR" not in env  # left to platform detection
    implied = platforms.detect({**env, "FT_PLATFORM": "sagemaker"})[1]
    deadline = int(env.get("FT_STOP_DEADLINE_SECONDS", implied["FT_STOP_DEADLINE_SECONDS"]))
    assert deadline < 120  # SageMaker sends SIGKILL 120 s after SIGTERM
    _assert_known_settings(env)


def test_vertex_custom_job_parses_into_the_official_custom_job_message():
    for text in _texts(DEPLOY / "vertex" / "custom-job-spec.yaml").values():
        spec = yaml.safe_load(text)
        document = json.dumps({"displayName": "fulltune-qwen3-4b", "jobSpec": spec})
        job = aiplatform_v1.CustomJob.from_json(document, ignore_unknown_fields=False)  # raises on unknown fields
    (pool,) = job.job_spec.worker_pool_specs
    assert pool.machine_spec.accelerator_type == aiplatform_v1.AcceleratorType.NVIDIA_H100_80GB
    assert (pool.machine_spec.accelerator_count, pool.replica_count) == (1, 1)
    assert job.job_spec.base_output_directory.output_uri_prefix.startswith("gs://")  # sets AIP_CHECKPOINT_DIR
    assert job.job_spec.scheduling.restart_job_on_worker_restart
    env = {e.name: e.value for e in pool.container_spec.env}
    assert "FT_OUTPUT_DIR" not in env  # from AIP_CHECKPOINT_DIR, mapped to /gcs by platform detection
    _assert_known_settings(env)


AZURE_CHECK = """
import sys
from azure.ai.ml import load_job
job = load_job(sys.argv[1])  # validates against azure-ai-ml's CommandJob schema; unknown keys are errors
print(type(job).__name__, job.command)
print(dict(job.environment_variables))
"""


def test_azureml_command_job_validates_against_the_sdk_schema(tmp_path):
    path = tmp_path / "command-job.yml"
    # Only ${IMAGE} is ours: $schema and ${{outputs.output_dir}} belong to Azure ML (docs/deployment.md runs `envsubst '$IMAGE'`).
    path.write_text((DEPLOY / "azureml" / "command-job.yml").read_text().replace("${IMAGE}", PLACEHOLDERS["IMAGE"]))
    result = subprocess.run([validators_python(), "-c", AZURE_CHECK, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    kind, command = result.stdout.splitlines()[0].split(" ", 1)
    assert kind == "Command"
    assert command.startswith("FT_OUTPUT_DIR=${{outputs.output_dir}} env -u MLFLOW_TRACKING_URI python /app/entrypoint.py")
    env = yaml.safe_load(path.read_text())["environment_variables"]
    _assert_known_settings({**env, "FT_OUTPUT_DIR": str(tmp_path)})


@pytest.mark.slow  # the demo job, in a subprocess
def test_azureml_command_trains_although_azure_ml_points_mlflow_at_its_own_store(tmp_path):
    """The spec's command, run by a shell as Azure ML does, with the variables Azure ML sets (demo preset)."""
    import os
    import sys

    command = yaml.safe_load((DEPLOY / "azureml" / "command-job.yml").read_text())["command"]
    command = command.replace("${{outputs.output_dir}}", str(tmp_path / "output")).replace(
        "python /app/entrypoint.py", f"{sys.executable} {REPO / 'entrypoint.py'}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_"))} | {
        "AZUREML_RUN_ID": "fulltune-qwen3-4b_1700000000_abcdef",
        "MLFLOW_TRACKING_URI": "azureml://eastus.api.azureml.ms/mlflow/v1.0/subscriptions/x/resourceGroups/y/providers/Microsoft.MachineLearningServices/workspaces/z",
        "HF_HUB_OFFLINE": "1", "FT_PRESET": "demo", "FT_MAX_STEPS": "4", "FT_EVAL_STEPS": "4", "FT_SAVE_STEPS": "4", "FT_TERMINATION_MESSAGE_PATH": "",
    }
    result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stdout.startswith("fulltune: platform azureml detected by AZUREML_RUN_ID")
    assert (tmp_path / "output" / "mlflow" / "mlflow.db").exists() and (tmp_path / "output" / "final" / "model").is_dir()


def test_azureml_schema_check_rejects_an_unknown_field(tmp_path):
    path = tmp_path / "command-job.yml"
    text = (DEPLOY / "azureml" / "command-job.yml").read_text().replace("${IMAGE}", PLACEHOLDERS["IMAGE"])
    path.write_text(text.replace("\nlimits:", "\nlimitz:"))
    result = subprocess.run([validators_python(), "-c", AZURE_CHECK, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "limitz" in result.stderr


def _deploy_guide():
    """The "Run it" section of docs/deployment.md, between its deploy markers."""
    text = (REPO / "docs" / "deployment.md").read_text()
    return text[text.index("<!-- deploy:start -->") : text.index("<!-- deploy:end -->")]


def test_deploy_guide_has_a_copy_paste_block_per_target_naming_files_that_exist():
    guide = _deploy_guide()
    for target in ("Docker", "Kubernetes", "AWS Batch", "SageMaker", "Vertex AI", "Azure ML"):
        section = guide.split(f"### Run on {target}\n", 1)[1].split("\n### ", 1)[0]
        assert "```bash\n" in section, target
    for path in re.findall(r"\b((?:deploy|k8s)/[\w./$-]+\.(?:json|ya?ml))", guide):
        for overlay in ("generic", "gke", "eks") if "$OVERLAY" in path else ("",):  # the block's OVERLAY= choices
            assert (REPO / path.replace("$OVERLAY", overlay)).exists(), path
    for overlay in re.findall(r"k8s/overlays/(\w+)", guide) + ["generic", "gke", "eks"]:
        assert (REPO / "k8s" / "overlays" / overlay / "kustomization.yaml").exists(), overlay
