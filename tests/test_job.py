"""The reference job end to end on the demo preset: what lands on the volume, in MLflow and in the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch

from conftest import (
    DEMO_NAME,
    NO_EVALUATION,
    ROOT,
    SECRET,
    MlflowServer,
    assert_answers_as_transformers_does,
    committed_steps,
    greedy_reply,
    job_env,
    run_job,
    termination_message,
)


@pytest.fixture(scope="module")
def demo_job(demo_job_run):
    out, result = demo_job_run
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    return out, result


def only_run():
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert len(runs) == 1
    return runs[0]


PROMPT = "Reverse: apple river stone"


def served_greedy_answer(model, text: str, max_tokens: int) -> dict:
    """A chat request with temperature 0 (greedy) to the registered model, loaded in this process."""
    return model.predict({"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens})


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess
def test_demo_job_final_model_is_the_best_committed_checkpoint_and_replies_as_trained(demo_job):
    from safetensors.torch import load_file

    out, _ = demo_job
    assert committed_steps(out)[-2:] == [220, 240]  # FT_SAVE_TOTAL_LIMIT=2, and the best if it is older
    state = json.loads((out / "checkpoints" / "checkpoint-240" / "trainer_state.json").read_text())
    best = Path(state["best_model_checkpoint"])
    assert best.parent == out / "checkpoints" and best.name in {f"checkpoint-{step}" for step in committed_steps(out)}
    final, kept = load_file(out / "final" / "model" / "model.safetensors"), load_file(best / "model.safetensors")
    dtype = next(iter(final.values())).dtype  # fp32 on CPU; bf16 where the job trains in bf16 (checkpoints keep fp32 master weights)
    assert final.keys() == kept.keys() and all(torch.equal(final[name], kept[name].to(dtype)) for name in final), (
        "final/model holds the best checkpoint's weights"
    )
    reply = greedy_reply(out / "final" / "model", PROMPT, 8)
    assert reply == greedy_reply(best, PROMPT, 8, tokenizer_dir=out / "final" / "model", dtype=dtype)
    assert reply != greedy_reply(out / "demo" / "model", PROMPT, 8, tokenizer_dir=out / "final" / "model"), "the untrained model replies otherwise"


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess
def test_demo_job_run_is_finished_with_loss_eval_loss_and_the_effective_configuration(demo_job):
    out, result = demo_job
    run = only_run()
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "demo_full-fine-tuning"  # the model's name, not its path
    assert {"loss", "eval_loss"} <= set(run.data.metrics)
    assert run.data.params["FT_LEARNING_RATE"] == "0.001" and run.data.params["FT_PRESET"] == "demo"
    assert any(key.startswith("system/") for key in run.data.metrics), "system metrics are logged"
    everything = result.stdout + result.stderr + repr(run.data.params) + repr(run.data.tags)
    assert SECRET not in everything


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess
def test_the_run_holds_the_effective_settings_as_params_and_the_trainers_metrics_at_each_logging_step(demo_job):
    """fulltune logs the Trainer's metrics itself: no TrainingArguments params, no second run (report_to="none")."""
    from trainer.core import settings

    run = only_run()
    assert set(run.data.params) == set(settings.BY_ENV_NAME) | {"detected_platform", "precision"}
    assert run.data.params["precision"] == "fp32"  # FT_PRECISION=auto on CPU, as resolved once in entrypoint.py
    client = mlflow.MlflowClient()
    for metric in ("loss", "grad_norm", "learning_rate", "tokens_per_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == list(range(5, 241, 5)), metric
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")] == list(range(20, 241, 20))


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess
def test_demo_job_registers_a_version_linked_to_its_run_with_metadata(demo_job):
    from transformers import AutoModelForCausalLM

    from trainer.model.loading import describe_size

    out, _ = demo_job
    run = only_run()
    version = mlflow.MlflowClient().get_model_version(DEMO_NAME, "1")
    assert version.run_id == run.info.run_id
    assert version.tags["task"] == "llm/v1/chat"
    assert version.tags["model_family"] == "Qwen3ForCausalLM"
    saved = AutoModelForCausalLM.from_pretrained(out / "final" / "model")  # what the version serves, counted independently
    count = sum(p.numel() for p in saved.parameters())
    assert int(version.tags["parameter_count"]) == count and version.tags["model_size_parameters"] == describe_size(count)
    assert version.tags["pretrained_model_name"] == "fulltune-demo-tiny-qwen3"  # the demo's base model, not a temporary path


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess
def test_registered_version_serves_the_greedy_reply_transformers_generates_from_the_final_weights(demo_job):
    out, _ = demo_job
    model = mlflow.pyfunc.load_model(f"models:/{DEMO_NAME}/1")
    assert_answers_as_transformers_does(served_greedy_answer(model, PROMPT, 8), out / "final" / "model", PROMPT, 8)


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess
def test_registration_is_one_copy_of_the_weights_on_the_volume(demo_job):
    out, _ = demo_job
    weights = [p for p in out.rglob("*.safetensors") if "checkpoints" not in p.parts and "demo" not in p.parts]
    assert [p.relative_to(out) for p in weights] == [Path("final/model/model.safetensors")]


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path).start()
    yield server.url
    server.kill()


@pytest.mark.slow  # an MLflow server and the demo job in subprocesses
def test_job_against_a_real_mlflow_server(mlflow_server, tmp_path):
    out = tmp_path / "volume"
    env = job_env(
        out,
        FT_PRESET="demo",
        FT_MAX_STEPS="10",
        FT_EVAL_STEPS="10",
        FT_SAVE_STEPS="10",
        MLFLOW_TRACKING_URI=mlflow_server.replace("http://", "http://ci:pw-do-not-leak@"),  # the server ignores basic auth
        MLFLOW_EXPERIMENT_NAME="server-test",
        FT_RUN_NAME="nightly-7",  # not the default <model>_full-fine-tuning
        FT_REGISTERED_MODEL="ci.models.reverser",  # not the demo preset's name
    )
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (out / "mlflow").exists(), "with a server nothing of MLflow's is stored on the volume"
    on_volume = "".join(p.read_text(errors="replace") for p in (out / ".fulltune").rglob("*") if p.is_file())
    assert "127.0.0.1" in on_volume and "pw-do-not-leak" not in on_volume + result.stdout + result.stderr
    mlflow.set_tracking_uri(mlflow_server)
    runs = mlflow.search_runs(experiment_names=["server-test"], output_format="list")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "nightly-7"
    assert "eval_loss" in runs[0].data.metrics
    report = (out / "report.html").read_text()  # the run report, uploaded to the server's artifact store, names the server without the password
    assert "pw-do-not-leak" not in report and "****@127.0.0.1" in report
    assert Path(mlflow.MlflowClient().download_artifacts(runs[0].info.run_id, "report.html", str(tmp_path))).read_text() == report
    assert [m.name for m in mlflow.MlflowClient().search_registered_models()] == ["ci.models.reverser"]
    version = mlflow.MlflowClient().get_model_version("ci.models.reverser", "1")
    assert version.run_id == runs[0].info.run_id
    model = mlflow.pyfunc.load_model("models:/ci.models.reverser/1")  # downloaded from the server's artifact store
    answer = served_greedy_answer(model, "Reverse: apple stone", 4)
    assert_answers_as_transformers_does(answer, out / "final" / "model", "Reverse: apple stone", 4, name="ci.models.reverser")


@pytest.mark.faults("a model registry that refuses the registration")
@pytest.mark.slow  # the demo job twice, in subprocesses
def test_failed_registration_exits_3_keeps_the_model_and_a_retry_only_registers(tmp_path):
    out = tmp_path / "volume"
    env = job_env(out, FT_PRESET="demo", FT_MAX_STEPS="10", FT_EVAL_STEPS="10", FT_SAVE_STEPS="10", FT_REGISTRATION_RETRY_SECONDS="0")  # 0 = one try
    bad_registry = env | {"MLFLOW_REGISTRY_URI": "http://127.0.0.1:9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
    result = run_job(bad_registry)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"saved at {out}/final" in result.stderr
    assert (out / "final" / "model" / "model.safetensors").exists()
    assert "exit 3" in termination_message(env)

    retry = run_job(env)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "starting from step" not in retry.stdout and "resuming" not in retry.stdout
    assert "memory plan" not in retry.stdout and "fulltune: data" not in retry.stdout  # straight to the registry
    assert f"registered {DEMO_NAME}/1" in retry.stdout


@pytest.mark.faults("a tracking URI this MLflow cannot use")
def test_a_tracking_uri_this_mlflow_cannot_use_exits_2_before_training_without_its_password(tmp_path):
    out = tmp_path / "volume"
    env = job_env(out, FT_PRESET="demo", MLFLOW_TRACKING_URI="azureml://bob:s3cret-pw@eastus.api.azureml.ms/mlflow/v1.0/subscriptions/x")
    result = run_job(env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MLFLOW_TRACKING_URI='azureml://****@eastus.api.azureml.ms" in result.stderr and "azureml-mlflow" in result.stderr
    assert "Traceback" not in result.stderr and "exit 2" in termination_message(env)
    assert "s3cret-pw" not in result.stdout + result.stderr + termination_message(env)
    assert not (out / "checkpoints").exists() and not (out / "mlflow").exists()


@pytest.mark.slow  # the job, in a subprocess
@pytest.mark.parametrize("layout", ["parquet-shards", "save_to_disk"])
def test_local_datasets_train_end_to_end(layout, demo_assets, tmp_path):
    import datasets

    rows = datasets.load_dataset("json", data_files=str(demo_assets / "data" / "train.jsonl"), split="train").select(range(120))
    if layout == "parquet-shards":
        source = tmp_path / "shards"
        source.mkdir()
        for index in range(3):
            rows.shard(3, index).to_parquet(str(source / f"part-{index}.parquet"))
    else:
        source = tmp_path / "saved"
        rows.save_to_disk(str(source))
    out = tmp_path / "volume"
    env = job_env(out, FT_MODEL=str(demo_assets / "model"), FT_DATASET=str(source), FT_MAX_STEPS="2", FT_EVAL_STEPS="2", FT_SAVE_STEPS="2",
                  FT_BATCH_SIZE="4", FT_GRADIENT_ACCUMULATION_STEPS="1", FT_MAX_LENGTH="128", FT_REGISTERED_MODEL="", **NO_EVALUATION)
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "108 train / 12 validation rows" in result.stdout
    assert (out / "final" / "model" / "model.safetensors").exists()


# Not slow: 2 steps, the one run of the whole job (entrypoint, accelerate, training, saving) in the fast subset.
def test_runs_from_another_directory_with_a_relative_output_dir(tmp_path):
    env = job_env("./run", FT_PRESET="demo", FT_MAX_STEPS="2", FT_EVAL_STEPS="2", FT_SAVE_STEPS="2", FT_REGISTERED_MODEL="")
    env["FT_TERMINATION_MESSAGE_PATH"] = str(tmp_path / "termination-log")
    result = subprocess.run([sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "run" / "final" / "model" / "model.safetensors").exists()
