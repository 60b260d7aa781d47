"""The whole data path is right when the demo model learns a task it can only solve by reading the user turn.

The demo task (trainer/data/demo.py) asks to reverse a list of words: a model that is trained on the wrong
tokens, fed truncated or mis-rendered conversations, or saved without its tokenizer cannot answer
held-out prompts.  The model is trained through entrypoint.py and read back from FT_OUTPUT_DIR/final/model.
"""

from __future__ import annotations

import random

import pytest

from conftest import job_env, run_job
from trainer.data import demo

HELD_OUT = 40
THREADS = "1"
# The loss plateaus near 2.6 for ~200 steps, then drops to 0.005 by step 375 (batch 64, constant lr 1e-2, one thread);
# measured 40/40 held-out prompts at 400, 450 and 600 steps.  450 leaves 75 steps beyond the drop.
STEPS = "450"


def held_out_prompts(training_rows: set[str]) -> list[list[str]]:
    """Word lists the model has not seen: another seed than the demo data, and none of its training prompts."""
    rng, prompts = random.Random(20_251), []
    while len(prompts) < HELD_OUT:
        words = rng.sample(demo.WORDS, rng.randint(3, 6))
        if "Reverse: " + " ".join(words) not in training_rows:
            prompts.append(words)
    return prompts


@pytest.mark.slow
def test_demo_model_learns_to_reverse_held_out_word_lists(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    env = job_env(
        out,
        FT_PRESET="demo",
        FT_LOSS_ON="assistant",
        FT_MAX_STEPS=STEPS,
        FT_BATCH_SIZE="64",
        FT_GRADIENT_ACCUMULATION_STEPS="1",
        FT_LEARNING_RATE="1e-2",
        FT_WARMUP_STEPS="20",
        FT_LR_SCHEDULER="constant_with_warmup",
        FT_EVAL_FRACTION="0.05",
        FT_EVAL_STEPS=STEPS,
        FT_SAVE_STEPS=STEPS,
        FT_LOGGING_STEPS="50",
        FT_SYSTEM_METRICS="false",
        FT_REGISTERED_MODEL="",
        # Pinned: a different thread count sums in another order and moves the loss curve's late drop, so the
        # result would otherwise depend on the machine's cores.  One thread is the count the curve was measured with
        # (and leaves the other core to the other test worker); the launcher hands it on.
        OMP_NUM_THREADS=THREADS,
    )
    done = run_job(env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "assistant tokens (ChatML turns" in done.stdout

    seen = {row["messages"][-2]["content"] for row in demo.conversations(2000, seed=1234)}
    tokenizer = AutoTokenizer.from_pretrained(out / "final" / "model")
    net = AutoModelForCausalLM.from_pretrained(out / "final" / "model").eval()
    correct = 0
    for words in held_out_prompts(seen):
        messages = [{"role": "user", "content": "Reverse: " + " ".join(words)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            generated = net.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip()
        correct += answer == " ".join(reversed(words))
    print(f"exact match {correct}/{HELD_OUT}")
    assert correct / HELD_OUT >= 0.9, f"exact match {correct}/{HELD_OUT}"
