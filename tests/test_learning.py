"""The README's demo learns its task, and the whole data path is right when it does.

The demo task (trainer/data/demo.py) asks to reverse a list of words: a model that is trained on the wrong
tokens, fed truncated or mis-rendered conversations, or saved without its tokenizer cannot answer
held-out prompts.  The demo job runs as the README runs it (FT_PRESET=demo, nothing else; one thread here) and its
model is read back from FT_OUTPUT_DIR/final/model.  Its answers turn right between steps 75 and 150 of 240
(bench/demo_learning.py measures that window at several step counts, on 1 and 2 threads and other seeds), so
the test also finds them right at two thirds of the steps.
"""

from __future__ import annotations

import pytest

from trainer.console import progress
from trainer.data import demo
from trainer.evaluation import samples, scoring

HELD_OUT = 40


def answer_held_out(model_dir, pairs: list[tuple[str, str]]) -> int:
    """How many of the prompts the model in `model_dir` answers exactly right, greedily, as the sample answers are made."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    net = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for prompt, _ in pairs]
    replies = samples.answers(net, tokenizer, [list(p) for p in prompts], max_new_tokens=24)
    return sum(scoring.exactly_right(samples.decode(tokenizer, ids), answer) for ids, (_, answer) in zip(replies, pairs, strict=True))


@pytest.mark.slow  # the demo job, 240 steps, in a subprocess (conftest's demo_job_run)
def test_the_demo_answers_held_out_word_lists_right_well_before_its_last_step(demo_job_run):
    out, result = demo_job_run
    assert "assistant tokens (ChatML turns" in result.stdout  # the preset trains on the answers alone

    correct = answer_held_out(out / "final" / "model", demo.held_out(HELD_OUT))
    print(f"exact match {correct}/{HELD_OUT}")
    assert correct / HELD_OUT >= 0.9, f"exact match {correct}/{HELD_OUT}"

    rows = scoring.read_samples(out / "eval-samples.jsonl")
    steps = sorted({row["step"] for row in rows})
    early = min(step for step in steps if step >= steps[-1] * 2 / 3)  # 160 of 240
    right, answered = scoring.tally(row for row in rows if row["step"] == early)
    assert right * 2 >= answered, f"only {right} of {answered} right at step {early}: no margin left before the last step"
    at_start = scoring.tally(row for row in rows if row["step"] == 0)
    assert at_start[0] == 0, "the untrained model answers none"


@pytest.mark.slow  # the demo job, as above
def test_the_demo_says_in_its_last_lines_and_its_report_how_many_sample_answers_are_right(demo_job_run):
    out, result = demo_job_run
    lines = result.stdout.splitlines()
    summary = progress.parse_line(lines[-1])
    right, answered = map(int, summary["samples_right"].split("/"))
    assert answered == 8 and right * 2 >= answered, lines[-1]  # the demo's 8 sample prompts, at least half exactly right
    assert lines[-2].startswith(f"fulltune: sample answers at step 240, the last evaluation: {right} of {answered} exactly right")
    last = [row for row in scoring.read_samples(out / "eval-samples.jsonl") if row["step"] == 240]
    assert scoring.tally(last) == (right, answered) and sum(row["exact"] for row in last) == right
    page = (out / "report.html").read_text(encoding="utf-8")
    assert f"{right} of {answered} exactly right at step 240" in page
    assert page.count("✓ ") >= right  # each answer that is right is marked


@pytest.mark.slow  # the demo job, as above
def test_the_demo_ends_with_a_before_after_table_where_the_fine_tuned_model_beats_the_base_on_both_scores(demo_job_run):
    """Its own benchmark (held-out lists, an lm-eval task over local rows) and its own validation rows, in the log, the report,
    the MLflow run and the registered version."""
    import json

    import mlflow

    from conftest import DEMO_NAME

    out, result = demo_job_run
    summary = json.loads((out / "evaluation" / "summary.json").read_text())
    (bench,) = summary["benchmarks"]
    own = summary["own_task"]
    assert bench["task"] == demo.TASK and bench["tuned"] > bench["base"], bench
    assert own["rows"] == 24 and own["tuned"]["exact_match"] > own["base"]["exact_match"] and own["tuned"]["chrf"] > own["base"]["chrf"], own
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("fulltune: evaluation, base -> fine-tuned: ")]
    assert f"{demo.TASK} acc {bench['base']:.3f} -> {bench['tuned']:.3f}" in line
    assert f"own task (24 validation rows) exact match {own['base']['exact_match']:.0%} -> {own['tuned']['exact_match']:.0%}" in line
    assert "FT_EVAL_LIMIT" not in line  # every sample scored: nothing to label

    page = (out / "report.html").read_text(encoding="utf-8")
    table = page[page.index("<table id=evaluation>") :].split("</table>")[0]
    assert f"<td>{demo.TASK}</td><td>acc</td><td class=n>{bench['base']:.4f}</td><td class=n>{bench['tuned']:.4f}</td>" in table
    assert "own task (24 validation rows)" in table and "Worst own-task answers" in page

    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.metrics[f"eval/{demo.TASK}/acc/base"] == pytest.approx(bench["base"])
    assert run.data.metrics["eval/own_task/chrf/tuned"] == pytest.approx(own["tuned"]["chrf"])
    version = mlflow.MlflowClient().get_model_version(DEMO_NAME, "1")
    assert version.tags[f"eval.{demo.TASK}.acc"].startswith(f"{bench['base']:.4f} -> {bench['tuned']:.4f}")
    assert f"| {demo.TASK} | acc | {bench['base']:.4f} | {bench['tuned']:.4f} |" in version.description
