"""FT_EARLY_STOPPING_PATIENCE: a run whose eval loss stops improving ends early, successfully, with its best checkpoint."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from conftest import NO_EVALUATION, QUICK_DEMO, committed_steps, job_env, run_job


@pytest.mark.slow  # the demo job, 6 of 20 steps, in a subprocess
def test_a_run_whose_eval_loss_rises_stops_early_with_exit_0_and_the_best_checkpoint_as_final_model(tmp_path):
    out = tmp_path / "volume"
    # A constant learning rate of 0.05 on the quick demo's 8 sequences a step, loss on every token, overshoots after
    # the first steps: eval loss 4.94 at step 2, then 5.50 and 5.92 (CPU, fp32, fixed seed), so patience 2 stops at
    # step 6. (Loss on the replies only, the preset's default, keeps improving at this rate.)
    env = job_env(out, **(QUICK_DEMO | dict(FT_MAX_STEPS="20") | NO_EVALUATION), FT_LOSS_ON="all", FT_LEARNING_RATE="0.05",
                  FT_LR_SCHEDULER="constant_with_warmup", FT_WARMUP_STEPS="0", FT_EVAL_STEPS="2", FT_SAVE_STEPS="2",
                  FT_LOGGING_STEPS="2", FT_EARLY_STOPPING_PATIENCE="2", FT_REGISTERED_MODEL="")
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stop after 2 without improvement" in result.stdout  # the plan says it up front
    assert "fulltune: stopped early at step 6/20: eval_loss did not improve for 2 evaluation(s)" in result.stdout
    assert "at checkpoint-2, which becomes the final model" in result.stdout
    assert "step=8/20" not in result.stdout
    assert committed_steps(out) == [2, 4, 6]

    state = json.loads((out / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].endswith("checkpoint-2") and state["global_step"] == 6
    final, best = load_file(out / "final" / "model" / "model.safetensors"), load_file(out / "checkpoints" / "checkpoint-2" / "model.safetensors")
    last = load_file(out / "checkpoints" / "checkpoint-6" / "model.safetensors")
    assert all(torch.equal(final[name], best[name]) for name in final), "the final model is the best checkpoint"
    assert not all(torch.equal(final[name], last[name]) for name in final), "and not the last one"

    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["stopped_early_at_step"] == "6" and run.data.tags["best_checkpoint"] == "checkpoint-2"
    evals = mlflow.MlflowClient().get_metric_history(run.info.run_id, "eval_loss")
    assert [m.step for m in evals] == [2, 4, 6]
    assert evals[0].value < min(evals[1].value, evals[2].value)  # what patience 2 means: two evaluations no better
    assert json.loads((out / ".fulltune" / "status.json").read_text())["final_model"] == str(out / "final")
