"""Sample answers: the same validation prompts, answered by the base model and at every evaluation, on the volume and in MLflow."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch

from conftest import job_env, run_job
from trainer.evaluation import samples


@pytest.fixture(scope="module")
def sampled_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("samples") / "volume"
    result = run_job(job_env(out, FT_PRESET="demo", FT_MAX_STEPS="40", FT_REGISTERED_MODEL=""))  # evaluations at 20 and 40 (the preset's cadence)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in (out / "eval-samples.jsonl").read_text().splitlines()]
    return out, result.stdout, lines


def transformers_greedy(model_dir, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """What `generate` answers, greedily, from the weights in `model_dir`: one prompt, no padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.slow  # the demo job, 40 steps, in a subprocess
def test_the_same_validation_prompts_are_answered_at_step_0_and_at_each_evaluation(sampled_job):
    out, log, lines = sampled_job
    assert [line["step"] for line in lines] == [0] * 8 + [20] * 8 + [40] * 8  # the preset's FT_EVAL_SAMPLES=8
    by_step = {step: [(line["row"], line["prompt"], line["reference"]) for line in lines if line["step"] == step] for step in (0, 20, 40)}
    assert by_step[0] == by_step[20] == by_step[40], "the same prompts every time"
    for _, prompt, reference in by_step[0]:  # a validation row of the demo, cut where the assistant's turn starts
        words = prompt.split("Reverse: ")[1].split("<|im_end|>")[0].split()
        assert prompt.endswith("<|im_start|>assistant\n") and reference == " ".join(reversed(words))
    assert all(0 < line["tokens"] <= 16 for line in lines)  # FT_EVAL_SAMPLE_TOKENS, 16 in the demo preset
    said = [line for line in log.splitlines() if line.startswith("fulltune: sample answers at step")]
    assert said[0].startswith("fulltune: sample answers at step 0: 0 of 8 exactly right")
    assert all(line["exact"] == (line["answer"] == line["reference"]) for line in lines)


@pytest.mark.slow  # the demo job, 40 steps, in a subprocess
def test_each_answer_is_what_transformers_generates_greedily_from_that_steps_weights(sampled_job):
    from transformers import AutoTokenizer

    out, _, lines = sampled_job
    tokenizer = AutoTokenizer.from_pretrained(out / "final" / "model")
    weights = {0: out / "demo" / "model", 20: out / "checkpoints" / "checkpoint-20", 40: out / "checkpoints" / "checkpoint-40"}
    for line in lines:
        assert line["answer"] == transformers_greedy(weights[line["step"]], tokenizer, line["prompt"], 16), line
    assert {line["answer"] for line in lines if line["step"] == 0} != {line["answer"] for line in lines if line["step"] == 40}, "training changed the answers"


@pytest.mark.slow  # the demo job, 40 steps, in a subprocess
def test_the_answers_are_a_table_of_the_mlflow_run(sampled_job):
    out, _, lines = sampled_job
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    table = mlflow.MlflowClient().load_table(run.info.experiment_id, "eval_samples.json", run_ids=[run.info.run_id])
    assert table.to_dict("records") == lines
    seconds = mlflow.MlflowClient().get_metric_history(run.info.run_id, "eval_samples_seconds")
    assert [m.step for m in seconds] == [0, 20, 40] and all(m.value < 30 for m in seconds)


def test_the_prompts_are_chosen_reproducibly_from_the_validation_rows(demo_assets):
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_assets / "model")
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Reverse: a{i} b{i}"}, {"role": "assistant", "content": f"b{i} a{i}"}], tokenize=False)
        for i in range(50)
    ]
    rows = datasets.Dataset.from_dict({"input_ids": [tokenizer.encode(t, add_special_tokens=False) for t in texts]})
    first, again, other = (samples.pick(rows, 4, seed, tokenizer) for seed in (42, 42, 7))
    assert [s["row"] for s in first] == [s["row"] for s in again] != [s["row"] for s in other]
    for sample in first:
        assert tokenizer.decode(sample["reference_ids"], skip_special_tokens=True).strip() == f"b{sample['row']} a{sample['row']}"
    assert samples.pick(rows, 0, 42, tokenizer) == [] and samples.pick(None, 4, 42, tokenizer) == []
