"""What a training step waits for on the input side: the Trainer's dataloader, with 0 and N workers.

    .venv/bin/python bench/dataloader.py [--steps 200] [--workers 0,2]

Builds the Trainer of the real job (`trainer.sft_trainer.build_trainer`: padding-free collator, 8 sequences a step) on
rows shaped like data.prepare's output (`input_ids` and `labels`, int32, Arrow-backed) with
Capybara-like lengths (bench/synthetic.py's log-normal, mean ~1.1k tokens, cut at 2048), then times
`get_train_dataloader()` alone: reading rows, collating, and handing the batch over.  The number to
compare is a training step of Qwen3-4B: 8 x 1.1k tokens at 16k tokens/s (the issue's target) is ~0.55 s.
No model runs, so this measures the input side only; it prints milliseconds per optimizer step.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rows(n: int, mean_tokens: int, max_length: int, seed: int = 0):
    """Token rows with bench/synthetic.py's length distribution; half the tokens carry loss."""
    from datasets import Dataset, Features, List, Value

    from bench import synthetic

    rng = random.Random(seed)
    ids, labels = [], []
    for _ in range(n):
        length = min(synthetic.length(rng, mean_tokens), max_length)
        row = [rng.randrange(10, 8000) for _ in range(length)]
        ids.append(row)
        labels.append([-100] * (length // 2) + row[length // 2 :])
    features = Features({"input_ids": List(Value("int32")), "labels": List(Value("int32"))})
    return Dataset.from_dict({"input_ids": ids, "labels": labels}, features=features)


def seconds_per_step(workers: int, data, steps: int, sequences_per_step: int) -> tuple[float, int]:
    """Mean wall time per optimizer step's batches, after a warm-up step (workers started)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench import synthetic
    from trainer import sft_trainer
    from trainer.core import config as job_config
    from trainer.core import settings as settings_table
    from trainer.data import prepare as job_data
    from trainer.model.memory import Plan

    with tempfile.TemporaryDirectory() as out:
        env = {"FT_PLATFORM": "none", "FT_OUTPUT_DIR": out, "FT_DATALOADER_WORKERS": str(workers), "FT_MAX_LENGTH": "2048", "FT_TERMINATION_MESSAGE_PATH": ""}
        config = job_config.build(settings_table.load(env), cuda=False, bf16_supported=False)
        tokenizer = synthetic.tokenizer()
        tiny = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16)
        net = Qwen3ForCausalLM(tiny)
        prepared = job_data.Prepared(train=data, eval=data.select(range(2)), report={})
        trainer = sft_trainer.build_trainer(config, tokenizer, prepared, Plan(sequences_per_step, 1, 0, {}, 0.0), net=net)  # the job's own Trainer
        loader = trainer.get_train_dataloader()
        batches = iter(loader)
        next(batches)  # warm-up: workers fork and prefetch here
        tokens, t0 = 0, time.perf_counter()
        for _ in range(steps):
            batch = next(batches)
            tokens += int(torch.as_tensor(batch["input_ids"]).numel())
        return (time.perf_counter() - t0) / steps, tokens // steps


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--rows", type=int, default=2000)
    args = p.parse_args(argv)
    data = rows(args.rows, mean_tokens=1100, max_length=2048)
    mean = sum(len(r) for r in data["input_ids"]) / args.rows
    print(f"dataloader: {args.rows} rows, {mean:.0f} tokens/row on average, 8 sequences a step, {os.cpu_count()} CPUs")
    for workers in (int(w) for w in args.workers.split(",")):
        seconds, tokens = seconds_per_step(workers, data, args.steps, 8)
        print(f"dataloader: FT_DATALOADER_WORKERS={workers}: {seconds * 1e3:.2f} ms per optimizer step ({tokens} tokens), "
              f"{seconds / 0.55:.2%} of a 0.55 s Qwen3-4B step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
