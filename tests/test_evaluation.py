"""The evaluation stage after training (trainer/evaluation/): base against fine-tuned, the gate, a stop during
the stage, and the base scores kept for the next job.  Each job runs as a user runs it (entrypoint.py in a
subprocess, the demo's tiny model, lm-eval on local task YAMLs: nothing downloads)."""

from __future__ import annotations

import json
import signal
import weakref
from pathlib import Path

import mlflow
import pytest

from conftest import DEMO_NAME, QUICK_DEMO, job_env, run_job, start_job, wait_for, with_faults
from trainer.data import demo
from trainer.evaluation import compare, harness

REPEAT_TASK = "fulltune_test_repeat"


def repeat_task(folder: Path) -> Path:
    """A benchmark the demo's fine-tune makes worse: which of two orders of a list repeats it (the demo learns to reverse)."""
    folder.mkdir(parents=True)
    rows = [{"prompt": p, "choices": [p.removeprefix("Reverse: "), a], "answer": 0} for p, a in demo.held_out(40, seed=999)]
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    yaml = demo.TASK_YAML.format(task=REPEAT_TASK, rows=json.dumps(str(folder / "rows.jsonl")))
    (folder / f"{REPEAT_TASK}.yaml").write_text(yaml)
    return folder


def store(out: Path) -> mlflow.MlflowClient:
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    return mlflow.MlflowClient()


def summary(out: Path) -> dict:
    return json.loads((out / "evaluation" / "summary.json").read_text())


def the_line(stdout: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.startswith("fulltune: evaluation, base -> fine-tuned: ")]
    return line


def computed(stdout: str, model: str, unit: str) -> bool:
    """The log says this unit was evaluated in this attempt (not read from the volume or the cache)."""
    return any(line.startswith(f"fulltune: evaluating: {model}, {unit}: ") and " in " in line and "read from" not in line
               for line in stdout.splitlines())


@pytest.mark.slow  # the demo job as the README runs it (240 steps), then two re-runs that train nothing
def test_the_gate_keeps_a_model_that_got_worse_out_of_the_registry_with_exit_9_and_a_rerun_without_it_registers(tmp_path):
    out = tmp_path / "volume"
    env = job_env(out, FT_PRESET="demo", FT_EVAL_TASKS=f"{out}/demo/eval-tasks,{repeat_task(tmp_path / 'tasks')}", FT_EVAL_MAX_REGRESSION="0.1")
    result = run_job(env, timeout=600)
    assert result.returncode == 9, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    rows = {row["task"]: row for row in summary(out)["benchmarks"]}
    assert rows[demo.TASK]["tuned"] > rows[demo.TASK]["base"]  # what it was trained for got better...
    fell = rows[REPEAT_TASK]
    assert fell["base"] - fell["tuned"] > 0.1, fell  # ...and what it forgot got worse
    message = f"{REPEAT_TASK} acc fell from {fell['base']:.4f} to {fell['tuned']:.4f}"
    assert f"fulltune: exit 9: the fine-tuned model is worse than the base model: {message}" in result.stderr
    assert "FT_EVAL_MAX_REGRESSION=0.1" in result.stderr and f"saved at {out}/final/model and was not registered" in result.stderr
    assert f"{REPEAT_TASK} acc {fell['base']:.3f} -> {fell['tuned']:.3f}" in the_line(result.stdout)
    assert store(out).search_registered_models() == []
    assert (out / "final" / "model" / "model.safetensors").exists() and "registered" not in json.loads((out / ".fulltune" / "status.json").read_text())
    page = (out / "report.html").read_text()
    assert "not registered (exit 9): the fine-tuned model is worse than the base model" in page and REPEAT_TASK in page

    again = run_job(env)  # the same settings: the same verdict, nothing trained or evaluated again
    assert again.returncode == 9 and message in again.stderr, again.stdout + again.stderr
    assert "starting from step" not in again.stdout and "fulltune: evaluating:" not in again.stdout

    allowed = run_job(env | {"FT_EVAL_MAX_REGRESSION": "0"})  # the user accepts the drop: registered, nothing trained or evaluated
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "starting from step" not in allowed.stdout and "fulltune: evaluating:" not in allowed.stdout
    version = store(out).get_model_version(DEMO_NAME, "1")
    assert version.tags[f"eval.{REPEAT_TASK}.acc"] == f"{fell['base']:.4f} -> {fell['tuned']:.4f} ({fell['tuned'] - fell['base']:+.4f})"
    assert f"| {REPEAT_TASK} | acc | {fell['base']:.4f} | {fell['tuned']:.4f} |" in version.description


@pytest.mark.slow  # a demo job stopped in its evaluation stage, then restarted
@pytest.mark.faults("SIGTERM during the evaluation stage")
def test_a_stop_during_the_evaluation_exits_75_and_the_restart_evaluates_only_what_is_left_without_training(tmp_path):
    out, held = tmp_path / "volume", tmp_path / "held"
    env = job_env(out, **QUICK_DEMO, FT_EVAL_LIMIT="8")
    job = start_job(with_faults(env, hold_evaluation=f"{held}:2"), tmp_path / "first.log")
    wait_for(held.exists, timeout=300, what="the evaluation stage's second unit")
    job.send_signal(signal.SIGTERM)  # to entrypoint.py, as a container stop sends it
    assert job.wait(timeout=60) == 75, (tmp_path / "first.log").read_text()
    first = (tmp_path / "first.log").read_text()
    assert "SIGTERM received during the evaluation stage: the scores done are kept on the volume" in first
    assert sorted(p.name for p in (out / "evaluation").iterdir()) == ["base-fulltune_demo_reverse.json", "base-own_task.json", "rows.json"]
    assert not (out / ".fulltune" / "status.json").read_text().count("registered")

    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "starting from step" not in result.stdout and "step=" not in result.stdout  # no training step runs
    assert not computed(result.stdout, "base model", "own task") and not computed(result.stdout, "base model", demo.TASK)
    assert computed(result.stdout, "fine-tuned model", "own task") and computed(result.stdout, "fine-tuned model", demo.TASK)
    assert f"fulltune: registered {DEMO_NAME}/1" in result.stdout
    page = (out / "report.html").read_text()  # the training attempt's page, with the evaluation the restart finished
    assert f"finished: the final model is saved, registered as {DEMO_NAME}/1" in page and "<table id=evaluation>" in page
    assert "FT_EVAL_LIMIT=8: each task was scored on its first 8 samples only" in page
    # a limited run says so wherever its numbers are shown
    assert the_line(result.stdout).endswith("[FT_EVAL_LIMIT=8: each task's first 8 samples]")
    assert summary(out)["limit"] == 8 and json.loads((out / "evaluation" / "base-fulltune_demo_reverse.json").read_text())["lm_eval"]["config"]["limit"] == 8
    client = store(out)
    version = client.get_model_version(DEMO_NAME, "1")
    assert version.tags["eval.limit"] == "8" and "FT_EVAL_LIMIT=8: each task's first 8 samples" in version.description
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    tuned = run.data.metrics[f"eval/{demo.TASK}/acc/tuned"]
    assert run.data.metrics[f"eval/{demo.TASK}/acc/change"] == pytest.approx(tuned - run.data.metrics[f"eval/{demo.TASK}/acc/base"])
    assert {"eval/own_task/exact_match/base", "eval/own_task/chrf/tuned"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/lm-eval-base.json", "evaluation/lm-eval-tuned.json", "evaluation/summary.json"} <= artifacts

    done = run_job(env)
    assert done.returncode == 0 and "already finished" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow  # two short demo jobs on one base model
def test_the_next_job_on_the_same_base_reads_the_base_scores_and_scores_only_its_own_model(tmp_path):
    shared = tmp_path / "base-scores"
    first_out = tmp_path / "first"
    first = run_job(job_env(first_out, **QUICK_DEMO, FT_EVAL_CACHE_DIR=str(shared), FT_EVAL_ROWS="0"))
    assert first.returncode == 0, first.stdout + first.stderr
    assert computed(first.stdout, "base model", demo.TASK)
    (kept,) = shared.iterdir()
    assert kept.name.startswith(f"{demo.TASK}-")

    # another job, another volume and data, the same base model and task: the base is not evaluated again
    second_out = tmp_path / "second"
    base = first_out / "demo"
    second = run_job(job_env(second_out, **(QUICK_DEMO | {"FT_MAX_STEPS": "10"}), FT_MODEL=str(base / "model"), FT_EVAL_TASKS=str(base / "eval-tasks"),
                             FT_EVAL_CACHE_DIR=str(shared), FT_EVAL_ROWS="0"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"fulltune: evaluating: base model, {demo.TASK}: scores read from {kept}" in second.stdout
    assert not computed(second.stdout, "base model", demo.TASK) and computed(second.stdout, "fine-tuned model", demo.TASK)
    assert summary(second_out)["benchmarks"][0]["base"] == summary(first_out)["benchmarks"][0]["base"]


def test_an_unknown_benchmark_exits_2_before_training_with_lm_evals_nearest_names(tmp_path):
    result = run_job(job_env(tmp_path / "volume", **QUICK_DEMO, FT_EVAL_TASKS="arc_eazy"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FT_EVAL_TASKS: no lm-eval task 'arc_eazy' (did you mean 'arc_easy'" in result.stderr
    assert "starting from step" not in result.stdout and not (tmp_path / "volume" / "checkpoints").exists()


def test_a_task_folder_that_does_not_exist_or_holds_no_yaml_exits_2_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder, why in ((tmp_path / "nowhere", "is not a folder"), (tmp_path / "empty", "holds no task YAML")):
        result = run_job(job_env(tmp_path / "volume", **QUICK_DEMO, FT_EVAL_TASKS=str(folder)))
        assert result.returncode == 2 and "  FT_EVAL_TASKS=" in result.stderr and f"{folder} {why}" in result.stderr, result.stderr
    gate_alone = run_job(job_env(tmp_path / "volume", **QUICK_DEMO, FT_EVAL_TASKS="", FT_EVAL_MAX_REGRESSION="0.02"))
    assert gate_alone.returncode == 2 and "FT_EVAL_MAX_REGRESSION='0.02': gates on benchmarks: set FT_EVAL_TASKS too" in gate_alone.stderr


def test_a_drop_is_measured_against_the_direction_lm_eval_says_is_better():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "perplexity,none": 9.0, "exact_match,strict-match": 0.25}},
               "higher_is_better": {"t": {"acc": True, "perplexity": False, "exact_match": True}}}
    base = harness.metrics(results)
    assert base == {"t": {"acc": 0.5, "perplexity": 9.0, "exact_match/strict-match": 0.25}}
    tuned = {"t": {"acc": 0.45, "perplexity": 12.0, "exact_match/strict-match": 0.5}}
    table = compare.rows(base, tuned, harness.higher_is_better(results))
    fell = compare.drops(table, 0.04)
    assert len(fell) == 2 and fell[0].startswith("t acc fell from 0.5000 to 0.4500") and fell[1].startswith("t perplexity fell from 9.0000 to 12.0000")
    assert compare.drops(table, 5.0) == []


def test_freeing_the_training_memory_leaves_no_reference_to_the_trained_model(tmp_path):
    """What the job does before the evaluation loads its models: the trained model (and its optimizer state) and the
    trainer are collected, although the job trained them frozen out of the collector's walks (trainer/core/collector.py)
    and the trainer sits in reference cycles (as transformers' hooks and the job's callbacks put it)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from trainer.core import collector
    from trainer.evaluation.stage import empty_device, free_training_memory

    assets = Path(demo.ensure_demo(str(tmp_path)))
    net = AutoModelForCausalLM.from_pretrained(assets / "model")
    rows = Dataset.from_list([{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 4)
    trainer = Trainer(model=net, args=TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=1, use_cpu=True, report_to="none",
                                                        save_strategy="no", per_device_train_batch_size=2), train_dataset=rows)
    trainer.itself = trainer  # cycles: only the collector frees them
    net.trainer = trainer
    with collector.frozen():
        trainer.train()
    model, optimizer, held = weakref.ref(net), weakref.ref(trainer.optimizer), weakref.ref(trainer)
    del net
    free_training_memory(trainer)
    del trainer
    empty_device()
    assert model() is None and optimizer() is None and held() is None
