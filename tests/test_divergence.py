"""A diverging run stops with exit 5: no NaN checkpoint is committed, nothing is registered, no final model is saved."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import mlflow
import pytest
from safetensors.torch import load_file
from transformers import TrainerCallback

from conftest import NO_EVALUATION, QUICK_DEMO, committed_steps, job_env, run_job, termination_message
from trainer import sft_trainer
from trainer.checkpointing import divergence
from trainer.core import config as job_config
from trainer.core import settings as settings_table
from trainer.core.errors import Diverged
from trainer.data import prepare as data
from trainer.model import loading as model
from trainer.model import memory


def finite(checkpoint) -> bool:
    return all(bool(t.isfinite().all()) for t in load_file(checkpoint / "model.safetensors").values())


@pytest.mark.faults("a learning rate that makes the loss NaN")
@pytest.mark.slow
def test_a_huge_learning_rate_exits_5_naming_the_step_and_the_last_good_checkpoint_and_a_retry_diverges_again(tmp_path):
    out = tmp_path / "volume"
    env = job_env(out, **QUICK_DEMO, **NO_EVALUATION, FT_LEARNING_RATE="1000", FT_EVAL_STEPS="5", FT_SAVE_STEPS="5", FT_SYSTEM_METRICS="false")
    result = run_job(env)
    assert result.returncode == 5, result.stdout + result.stderr
    assert "step=10/40 loss=nan" in result.stdout  # logged as NaN, not hidden as the window's average
    last_good = out / "checkpoints" / "checkpoint-5"
    assert "exit 5: training diverged at step 10: the weights hold NaN or infinite values" in result.stderr
    assert f"the last good checkpoint is {last_good}" in result.stderr and "Traceback" not in result.stderr
    assert "exit 5: training diverged at step 10" in termination_message(env)

    assert committed_steps(out) == [5] and finite(last_good)
    assert not (out / "checkpoints" / "checkpoint-10").exists()
    (aside,) = (out / "incomplete").iterdir()
    assert re.fullmatch(r"checkpoint-10\.not-finite\.\d+", aside.name) and not finite(aside) and not (aside / "commit.json").exists()
    assert not (out / "final").exists() and not (out / ".fulltune" / "status.json").exists()
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    assert mlflow.MlflowClient().search_registered_models() == []
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.status == "FAILED" and math.isnan(run.data.metrics["loss"])

    retry = run_job(env)
    assert retry.returncode == 5, retry.stdout + retry.stderr
    assert f"resuming from {last_good}" in retry.stdout and "training diverged at step 10" in retry.stderr
    assert committed_steps(out) == [5] and len(list((out / "incomplete").iterdir())) == 2


def in_process(demo_assets, tmp_path, **env: str):
    """The job's trainer on 24 demo rows, logging every step, without MLflow."""
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join((demo_assets / "data" / "train.jsonl").read_text().splitlines(True)[:24]))
    values = {
        "FT_MODEL": str(demo_assets / "model"), "FT_DATASET": str(rows), "FT_OUTPUT_DIR": str(tmp_path / "volume"), "FT_PLATFORM": "none",
        "FT_MAX_STEPS": "4", "FT_EVAL_STEPS": "2", "FT_SAVE_STEPS": "2", "FT_LOGGING_STEPS": "1", "FT_WARMUP_STEPS": "0", "FT_BATCH_SIZE": "4",
        "FT_GRADIENT_ACCUMULATION_STEPS": "1", "FT_MAX_LENGTH": "64", "FT_EVAL_FRACTION": "0.2", "FT_TERMINATION_MESSAGE_PATH": "", "FT_REGISTERED_MODEL": "",
    }
    config = job_config.build(settings_table.load(values | env), cuda=False, bf16_supported=False)
    tokenizer = model.load_tokenizer(config.settings)
    return config, tokenizer, data.prepare(config.settings, tokenizer), memory.preflight(config)


@pytest.mark.faults("a loss above FT_LOSS_LIMIT")
def test_a_loss_above_the_limit_stops_the_job_after_the_patience(demo_assets, tmp_path):
    config, tokenizer, prepared, plan = in_process(demo_assets, tmp_path, FT_LOSS_LIMIT="1", FT_DIVERGENCE_PATIENCE="3")  # the demo starts near 6
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan)
    with pytest.raises(
        Diverged, match=r"training diverged at step 3: the training loss [\d.]+ is above FT_LOSS_LIMIT=1 at 3 logging step\(s\) in a row"
    ) as caught:
        trainer.train()
    assert f"the last good checkpoint is {tmp_path / 'volume' / 'checkpoints' / 'checkpoint-2'}." in str(caught.value)
    assert committed_steps(tmp_path / "volume") == [2]


def test_off_with_patience_0_and_a_limit_only_counts_when_set(demo_assets, tmp_path):
    config, tokenizer, prepared, plan = in_process(demo_assets, tmp_path, FT_LOSS_LIMIT="1", FT_DIVERGENCE_PATIENCE="0")
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan)
    trainer.train()
    assert trainer.state.global_step == 4 and committed_steps(tmp_path / "volume") == [2, 4]


def test_the_streak_counts_consecutive_diverged_logging_steps_only():
    watch = divergence.StopOnDivergence(patience=2, limit=100.0)
    args = SimpleNamespace(output_dir="/nonexistent/checkpoints")
    for step, loss in enumerate([float("nan"), 3.0, float("inf"), 5.0, 250.0, 4.0], start=1):
        watch.on_log(args, SimpleNamespace(global_step=step), None, logs={"loss": loss})
    watch.on_log(args, SimpleNamespace(global_step=7), None, logs={"eval_loss": float("nan")})  # evaluation is not the training loss
    with pytest.raises(Diverged, match=r"at step 9: the training loss is nan at 2 logging step\(s\) in a row .*no checkpoint was committed before it"):
        for step, loss in ((8, float("nan")), (9, float("nan"))):
            watch.on_log(args, SimpleNamespace(global_step=step), None, logs={"loss": loss})


class PoisonWeights(TrainerCallback):
    """A fault from outside: after step 1, one weight holds a NaN (as an overflowing update would leave it); step 2 spreads it."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            import torch

            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")


@pytest.mark.faults("NaN weights in a checkpoint")
def test_a_checkpoint_with_nan_weights_is_set_aside_uncommitted_even_with_the_loss_watch_off(demo_assets, tmp_path):
    config, tokenizer, prepared, plan = in_process(demo_assets, tmp_path, FT_DIVERGENCE_PATIENCE="0")
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan, callbacks=(PoisonWeights(),))
    with pytest.raises(Diverged, match=r"at step 2: the weights hold NaN or infinite values \(model\.embed_tokens\.weight, .* and \d+ more\); "
                                       r"that checkpoint is set aside in .*checkpoint-2\.not-finite"):
        trainer.train()
    out = tmp_path / "volume"
    assert committed_steps(out) == [] and not (out / "checkpoints" / "checkpoint-2").exists()
    (aside,) = (out / "incomplete").iterdir()
    assert aside.name.startswith("checkpoint-2.not-finite.") and not (aside / "commit.json").exists() and not finite(aside)
