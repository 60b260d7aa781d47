"""Sample answers: what the model says to a few fixed validation prompts, before training and at every evaluation.

    FT_EVAL_SAMPLES=4 prompts, picked once from the validation split with FT_SEED (the same ones every time);
    answered greedily, at most FT_EVAL_SAMPLE_TOKENS new tokens, in one left-padded `generate` call;
    appended to FT_OUTPUT_DIR/eval-samples.jsonl and to the MLflow run's `eval_samples.json` table:
        {"step": 20, "row": 113, "prompt": "<|im_start|>user\\n...", "reference": "...", "answer": "...", "tokens": 9, "exact": true}

`exact`: the answer is the reference (trainer/evaluation/scoring.py, the one rule); the log line says how many are.
The prompt is the validation row as the model sees it, up to and including the last generation prompt of the
chat template (`<|im_start|>assistant\\n` for Qwen3); the reference is the rest of the row.  Plain-text rows
(no chat template) are cut in half.  Step 0 is the base model.  Rank 0 generates while the other processes
wait at their next collective; under FSDP (weights sharded across processes) there are no samples.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from transformers import TrainerCallback

from trainer.core.config import Config
from trainer.core.files import append_lines, write_text
from trainer.core.volume import Volume
from trainer.data.prepare import Prepared
from trainer.evaluation import scoring
from trainer.model.memory import Plan
from trainer.tracking.run import Tracker

TABLE = "eval_samples.json"  # the MLflow run's artifact


def generation_prompt(tokenizer: Any) -> list[int]:
    """The tokens the chat template appends to ask for the assistant's turn (empty without a chat template)."""
    try:
        turn = [{"role": "user", "content": "x"}]
        asked = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        plain = tokenizer.apply_chat_template(turn, add_generation_prompt=False, tokenize=False)
    except (ValueError, TypeError):
        return []
    if not asked.startswith(plain) or asked == plain:
        return []
    return tokenizer.encode(asked[len(plain) :], add_special_tokens=False)


def split_row(ids: list[int], asks: list[int]) -> tuple[list[int], list[int]] | None:
    """(prompt, reference) at the last generation prompt of a tokenized row; halves of a plain-text row."""
    if asks:
        for start in range(len(ids) - len(asks), 0, -1):
            if ids[start : start + len(asks)] == asks:
                end = start + len(asks)
                return (ids[:end], ids[end:]) if end < len(ids) else None
        return None
    half = len(ids) // 2
    return (ids[:half], ids[half:]) if half else None


def pick(rows: Any, n: int, seed: int, tokenizer: Any) -> list[dict]:
    """`n` validation rows chosen with `seed` (the same ones on every run and restart), split into prompt and reference."""
    if rows is None or not n:
        return []
    asks = generation_prompt(tokenizer)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    chosen = []
    for index in order:
        parts = split_row(list(rows[index]["input_ids"]), asks)
        if parts:
            chosen.append({"row": index, "prompt_ids": parts[0], "reference_ids": parts[1]})
        if len(chosen) == n:
            break
    return sorted(chosen, key=lambda sample: sample["row"])


def answers(net: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, bf16_autocast: bool = False) -> list[list[int]]:
    """The greedy continuation of each prompt, up to and including the end-of-turn token or `max_new_tokens`: one
    `generate` call for all of them, left-padded (decoding costs a step per token whatever the batch)."""
    import torch

    device = next(net.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
        out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=pad,
                           eos_token_id=tokenizer.eos_token_id)
    replies = []
    for row in out[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        replies.append(row[:end])
    return replies


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def callbacks(config: Config, tokenizer: Any, prepared: Prepared, plan: Plan, tracker: Tracker) -> list[Any]:
    """The callback that answers FT_EVAL_SAMPLES validation prompts at step 0 and every evaluation (none under FSDP)."""
    settings = config.settings
    if not settings.eval_samples or prepared.eval is None or plan.strategy == "fsdp":
        return []
    chosen = pick(prepared.eval, settings.eval_samples, settings.seed, tokenizer)
    bf16 = config.cuda and config.precision.bf16
    return [SampleAnswers(tracker, tokenizer, chosen, settings.eval_sample_tokens, settings.output_dir, bf16)] if chosen else []


class SampleAnswers(TrainerCallback):
    """At step 0 (the base model) and after every evaluation, answer the fixed prompts and record the answers."""

    def __init__(self, tracker: Tracker, tokenizer: Any, chosen: list[dict], max_new_tokens: int, output_dir: str, bf16_autocast: bool):
        self.tracker, self.tokenizer, self.chosen, self.max_new_tokens, self.bf16_autocast = tracker, tokenizer, chosen, max_new_tokens, bf16_autocast
        self.path = Volume(output_dir).eval_samples

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if state.global_step == 0:
            if os.path.exists(self.path):
                os.remove(self.path)  # a fresh start: the answers of an earlier attempt belong to weights that are gone
            self.record(model, 0)
        else:
            self._keep_up_to(state.global_step)  # a resume: answers past the committed step are redone

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            self.record(model, state.global_step)

    def record(self, net: Any, step: int) -> None:
        started = time.perf_counter()
        rows = []
        was_training, attention = net.training, net.config._attn_implementation
        net.eval()
        if attention != "sdpa" and "flash" not in attention:
            net.set_attn_implementation("sdpa")  # generation's cached decoding; trainer/model/attention.py serves the packed training passes
        try:
            replies = answers(net, self.tokenizer, [sample["prompt_ids"] for sample in self.chosen], self.max_new_tokens, self.bf16_autocast)
            for sample, ids in zip(self.chosen, replies, strict=True):
                rows.append(
                    {
                        "step": step,
                        "row": sample["row"],
                        "prompt": self.tokenizer.decode(sample["prompt_ids"]),
                        "reference": decode(self.tokenizer, sample["reference_ids"]),
                        "answer": decode(self.tokenizer, ids),
                        "tokens": len(ids),
                    }
                )
                rows[-1]["exact"] = scoring.exactly_right(rows[-1]["answer"], rows[-1]["reference"])
        finally:
            if net.config._attn_implementation != attention:
                net.set_attn_implementation(attention)
            net.train(was_training)
        seconds = time.perf_counter() - started
        append_lines(self.path, (json.dumps(row, ensure_ascii=False) for row in rows))
        self.tracker.log_table(rows, TABLE)
        right, answered = scoring.tally(rows)
        self.tracker.log_metrics({"eval_samples_seconds": seconds, "eval_samples_exact_match": right / max(answered, 1)}, step)
        first = rows[0]["answer"] if rows else ""
        shown = first if len(first) <= 80 else first[:77] + "..."
        print(f"fulltune: sample answers at step {step}: {right} of {answered} exactly right, in {seconds:.1f} s ({self.path}); first: {shown!r}",
              flush=True)

    def _keep_up_to(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        write_text(self.path, "".join(kept))
