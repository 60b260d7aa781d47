"""FT_PUSH_TO_HUB: the model card the job writes, and what happens when the hub does not answer.

The hub is not reachable from the tests, so a push that succeeds is not tested here (docs/checkpoints.md#hugging-face-hub says so):
HF_ENDPOINT points huggingface_hub at a closed port on loopback, which is what a hub that does not answer looks like to
it, and the job must end with exit 8, the model and its card kept, and a retry that only pushes.
"""

from __future__ import annotations

import json

import pytest

from conftest import SECRET, free_port, job_env, run_job, termination_message

pytestmark = pytest.mark.slow  # the demo job in a subprocess
REPOSITORY = "fulltune-tests/tiny-demo"
STEPS = dict(FT_PRESET="demo", FT_MAX_STEPS="10", FT_EVAL_STEPS="5", FT_SAVE_STEPS="5", FT_LEARNING_RATE="2e-3")


@pytest.mark.faults("the Hugging Face hub not answering at the push")
def test_a_hub_that_does_not_answer_exits_8_keeping_the_model_and_its_card_and_a_retry_only_pushes(tmp_path):
    out = tmp_path / "volume"
    env = job_env(out, **STEPS, FT_PUSH_TO_HUB=REPOSITORY, HF_TOKEN=SECRET, HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    result = run_job(env)
    assert result.returncode == 8, result.stdout + result.stderr
    assert f"pushing it to the Hugging Face hub as {REPOSITORY} failed" in result.stderr and "Traceback" not in result.stderr
    assert f"the model is trained and saved at {out}/final/model" in result.stderr and "exit 8" in termination_message(env)
    status = json.loads((out / ".fulltune" / "status.json").read_text())
    assert status["registered"] and "pushed" not in status and (out / "final" / "model" / "model.safetensors").exists()

    card = (out / "final" / "model" / "README.md").read_text()
    run_id = json.loads((out / ".fulltune" / "mlflow_run.json").read_text())["run_id"]
    evals = [e for e in json.loads((out / "checkpoints" / "checkpoint-10" / "trainer_state.json").read_text())["log_history"] if "eval_loss" in e]
    assert card.startswith("---\nlibrary_name: transformers\n") and "- fulltune" in card  # the hub's metadata (a local base model has no base_model)
    assert "fulltune-demo-tiny-qwen3" in card  # the base model
    assert f"`{out}/demo/data/train.jsonl`, split `train`" in card  # the data
    assert "| `FT_LEARNING_RATE` | `0.002` |" in card and "| `FT_MAX_STEPS` | `10` |" in card and "| precision | `fp32` |" in card
    assert [f"| {e['step']} | {e['eval_loss']:.4f} |" for e in evals] == [line for line in card.splitlines() if line.startswith(("| 5 |", "| 10 |"))]
    assert f"MLflow run `{run_id}`" in card and "10 of 10 optimizer steps" in card  # the run
    summary = json.loads((out / "evaluation" / "summary.json").read_text())  # the evaluation stage's before/after table, after the stage
    assert card.count("## Base model against the fine-tuned one") == 1 and "| task | metric | base | fine-tuned | change |" in card
    own = summary["own_task"]
    assert f"| own task ({own['rows']} rows) | exact_match | {own['base']['exact_match']:.4f} | {own['tuned']['exact_match']:.4f} |" in card
    assert all(f"| {r['task']} | {r['metric']} | {r['base']:.4f} | {r['tuned']:.4f} |" in card for r in summary["benchmarks"]) and summary["benchmarks"]
    assert SECRET not in card + result.stdout + result.stderr + termination_message(env)

    retry = run_job(env)
    assert retry.returncode == 8, retry.stdout + retry.stderr
    assert "starting from step" not in retry.stdout and "resuming" not in retry.stdout  # no training
    assert f"pushing the final model and its card to the Hugging Face hub as {REPOSITORY}" in retry.stdout
    assert (out / "final" / "model" / "README.md").read_text() == card and SECRET not in retry.stdout + retry.stderr


@pytest.mark.faults("FT_PUSH_TO_HUB without a token")
def test_push_to_hub_without_a_token_exits_2_before_training(tmp_path):
    env = job_env(tmp_path / "volume", **STEPS, FT_PUSH_TO_HUB=REPOSITORY, HF_HOME=str(tmp_path / "hf-home"))
    env.pop("HF_TOKEN", None)
    result = run_job(env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"FT_PUSH_TO_HUB={REPOSITORY} needs a Hugging Face token with write access: set HF_TOKEN" in result.stderr
    assert "starting from step" not in result.stdout and "Traceback" not in result.stderr
