"""The job's log as a user reads it: one line per logging step and no warning that is not about their job."""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

import mlflow
import pytest

from conftest import job_env, run_job
from trainer.console import progress, quiet


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory):
    """The demo job as a fresh container runs it: no git on PATH, OMP_NUM_THREADS unset, the model registered."""
    out = tmp_path_factory.mktemp("log") / "volume"
    env = job_env(out, FT_PRESET="demo", FT_MAX_STEPS="10", FT_EVAL_STEPS="5", FT_SAVE_STEPS="5", FT_LOGGING_STEPS="5")
    env.pop("OMP_NUM_THREADS", None)
    env["PATH"] = str(Path(sys.executable).parent)  # the venv's python and nothing else: no git executable
    assert not any((Path(folder) / "git").exists() for folder in env["PATH"].split(os.pathsep))
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout + result.stderr


@pytest.mark.slow  # the demo job, 10 steps, in a subprocess
def test_each_logging_step_prints_one_progress_line_and_no_raw_dict(demo_log):
    out, log = demo_log
    lines = log.splitlines()
    progress_lines = [line for line in lines if line.startswith("fulltune: step=") and "checkpoint_blocked_s=" not in line]  # not the cost of a save
    kinds = Counter((progress.parse_line(line)["step"], tuple(sorted(progress.parse_line(line)))) for line in progress_lines)
    progress_keys = ("eta_s", "loss", "lr", "mem_gb", "step", "tokens_per_s")
    assert kinds == {("5/10", progress_keys): 1, ("10/10", progress_keys): 1, ("5/10", ("eval_loss", "step")): 1, ("10/10", ("eval_loss", "step")): 1}
    repeated = [line for line, n in Counter(line for line in lines if line.strip()).items() if n > 1]
    assert repeated == [], "a line printed twice"
    assert "{'loss'" not in log and "'eval_loss':" not in log and "{'train_runtime'" not in log, "transformers' raw logs dict"
    assert "Loading weights" not in log and "Writing model shards" not in log, "a progress bar at every load and checkpoint"
    # The metrics the dict carried still reach MLflow, at the same steps.
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    client = mlflow.MlflowClient()
    for metric in ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "eval_loss", "eval_runtime"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [5, 10], metric


@pytest.mark.slow  # the demo job, 10 steps, in a subprocess
def test_the_log_states_the_batch_layout_once_in_one_wording(demo_log):
    _, log = demo_log
    memory_plan = re.search(r"^fulltune: memory plan: (\d+) sequences x (\d+) passes per step", log, re.M)
    each_step = re.search(r"^  each step: (\d+) sequences x (\d+) passes \(FT_BATCH_SIZE=16 x FT_GRADIENT_ACCUMULATION_STEPS=4, regrouped", log, re.M)
    assert memory_plan and each_step and memory_plan.groups() == each_step.groups(), log
    assert "accumulation)" not in log, "the other wording of the same layout (4 x 2 accumulation)"
    assert re.search(r"^  10 steps \(FT_MAX_STEPS\), [0-9.]+ epoch\(s\) of \d+ steps x effective batch 64 = 640 sequences", log, re.M), log


@pytest.mark.slow  # the demo job, 10 steps, in a subprocess
def test_the_log_carries_no_spurious_warning(demo_log):
    _, log = demo_log
    for noise in (
        "Invalid value",  # libgomp, when the launcher handed OMP_NUM_THREADS=None to the training process
        "missing keys",  # the best-model reload, for the tied LM head
        "model card could not be retrieved",  # MLflow, looking a local folder up on the hub
        "Unable to find license information",
        "git executable",  # GitPython without git on PATH (the image)
        "Failed to import Git",
        "WARNING",
        "Traceback",
    ):
        assert noise not in log, noise
    assert not log.startswith("\n"), "blank lines (the demo tokenizer's training bars)"


def test_a_missing_key_that_is_not_a_tied_weight_is_still_reported():
    """The filter drops the tied LM head's report only; a key really missing from a checkpoint still warns."""
    import logging

    from trainer.data import demo

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    quiet.expect_tied_weights(demo.build_model(vocab_size=64, pad_token_id=0, eos_token_id=1))
    logger, handler = logging.getLogger("transformers.trainer"), Keep()
    logger.addHandler(handler)
    try:
        logger.warning("There were missing keys in the checkpoint model loaded: ['lm_head.weight'].")
        logger.warning("There were missing keys in the checkpoint model loaded: ['lm_head.weight', 'model.norm.weight'].")
    finally:
        logger.removeHandler(handler)
    assert seen == ["There were missing keys in the checkpoint model loaded: ['lm_head.weight', 'model.norm.weight']."]


LIBRARY_LINE = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (INFO|DEBUG) ", re.M)  # MLflow's own format


def summary_of(log: str) -> dict[str, str]:
    lines = [line for line in log.splitlines() if line.startswith("fulltune: summary ")]
    assert len(lines) == 1, log
    return progress.parse_line(lines[0].replace("fulltune: summary ", "fulltune: "))


@pytest.mark.slow  # the demo job, 10 steps, in a subprocess
def test_the_log_has_no_library_info_line_and_ends_on_a_summary_of_the_run(demo_log):
    out, log = demo_log
    assert not LIBRARY_LINE.search(log), LIBRARY_LINE.findall(log)
    assert "Creating initial MLflow database tables" not in log and "system metrics monitoring" not in log
    stdout_lines = [line for line in log.splitlines() if line.startswith("fulltune: ")]
    assert stdout_lines[-1].startswith("fulltune: summary "), "the summary is the job's last line"
    summary = summary_of(log)
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    assert summary["exit"] == "0" and summary["steps"] == "10/10"
    assert summary["eval_loss"] == f"{run.data.metrics['eval_loss']:.4f}"
    assert summary["model"] == str(out / "final" / "model") and summary["registered"] == "demo.default.tiny_qwen3_assistant/1"
    assert 0 < float(summary["wall_s"]) < 600


@pytest.mark.slow  # the demo job, 3 steps, in a subprocess
def test_log_level_debug_shows_the_libraries_lines_and_a_run_shorter_than_the_logging_steps_prints_its_loss(tmp_path):
    env = job_env(tmp_path / "volume", FT_PRESET="demo", FT_MAX_STEPS="3", FT_LOGGING_STEPS="10", FT_EVAL_STEPS="3", FT_SAVE_STEPS="3",
                  FT_REGISTERED_MODEL="", FT_LOG_LEVEL="debug")
    result = run_job(env)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "INFO mlflow" in log, "FT_LOG_LEVEL=debug keeps MLflow's INFO lines"
    assert re.search(r"^fulltune: debug: start-up: data checked at [0-9.]+ s$", log, re.M)
    losses = [line for line in log.splitlines() if line.startswith("fulltune: step=3/3 loss=")]
    assert len(losses) == 1, "the last step's training loss, though FT_LOGGING_STEPS=10 is longer than the run"
    summary = summary_of(log)
    assert summary["steps"] == "3/3" and "registered" not in summary


@pytest.mark.slow  # the training process starts, then refuses the data
def test_refused_data_prints_each_bad_row_once_and_the_summary_says_exit_2(demo_assets, tmp_path):
    import json

    rows = [{"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": f"hi {i}"}]} for i in range(20)]
    rows[7]["messages"][0]["role"] = "wizard"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_job(job_env(tmp_path / "volume", FT_MODEL=str(demo_assets / "model"), FT_DATASET=str(data), FT_REGISTERED_MODEL=""))
    log = result.stdout + result.stderr
    assert result.returncode == 2, log
    assert len([line for line in log.splitlines() if "wizard" in line]) == 1, log
    assert "fulltune: data: fulltune" not in log
    summary = summary_of(result.stdout)
    assert summary["exit"] == "2" and "model" not in summary and "steps" not in summary
