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

from trainer.data import demo
from trainer.tracking import progress, samples, scoring

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
