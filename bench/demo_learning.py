"""How far before its last step the demo has learned its task: exact match on held-out prompts, step by step.

    python bench/demo_learning.py --threads 1 --seed 42 [--every 20] [--prompts 40] [--steps 240]

Trains the demo preset as the README runs it (FT_PRESET=demo, nothing else changed but FT_SEED, which draws another
validation split and data order: a stand-in for another CPU, whose kernels sum in another order and so move the
trajectory) with the job's own trainer (`trainer.sft_trainer.build_trainer`, after the stages trainer/job.py runs before
it, without MLflow), on `--threads` torch threads.  Every `--every` steps it answers `--prompts` held-out prompts
(trainer/data/demo.py `held_out`) greedily, as the sample answers are made, and scores them with the job's one rule
(trainer/evaluation/scoring.py).  Prints one line per scoring, then the first step at which 90 % are right and the
steps left after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42, help="FT_SEED (42: the demo's own)")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--steps", type=int, default=0, help="FT_MAX_STEPS; 0: the preset's")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    from transformers import TrainerCallback

    from trainer import sft_trainer
    from trainer.core import config as job_config
    from trainer.core import settings as settings_table
    from trainer.data import demo
    from trainer.data import prepare as data
    from trainer.evaluation import samples, scoring
    from trainer.model import loading as model
    from trainer.model import memory

    torch.set_num_threads(args.threads)
    pairs = demo.held_out(args.prompts)
    out = tempfile.mkdtemp(prefix="fulltune-demo-learning-")
    env = {"FT_PRESET": "demo", "FT_OUTPUT_DIR": out, "FT_SEED": str(args.seed), "FT_PLATFORM": "none", "FT_REGISTERED_MODEL": "",
           "FT_TERMINATION_MESSAGE_PATH": "", **({"FT_MAX_STEPS": str(args.steps)} if args.steps else {})}
    demo.ensure_demo(out)
    config = job_config.build(settings_table.load(env), cuda=False, bf16_supported=False)
    tokenizer = model.load_tokenizer(config.settings)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
               for p, _ in pairs]
    scores: list[tuple[int, int]] = []
    started = time.perf_counter()

    class Score(TrainerCallback):
        def on_step_end(self, args_, state, control, model=None, **kwargs):
            if state.global_step % args.every and state.global_step != state.max_steps:
                return
            attention = model.config._attn_implementation
            model.eval()
            model.set_attn_implementation("sdpa")  # generation's cached decoding, as the sample answers switch to it
            replies = samples.answers(model, tokenizer, prompts, max_new_tokens=24)
            model.set_attn_implementation(attention)
            model.train()
            right = sum(scoring.exactly_right(samples.decode(tokenizer, ids), answer) for ids, (_, answer) in zip(replies, pairs, strict=True))
            scores.append((state.global_step, right))
            print(f"threads={args.threads} seed={args.seed} step={state.global_step}/{state.max_steps} exact={right}/{len(pairs)} "
                  f"elapsed_s={time.perf_counter() - started:.0f}", flush=True)

    prepared = data.prepare(config.settings, tokenizer)
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, memory.preflight(config), callbacks=(Score(),))
    trainer.train()
    solid = next((step for step, right in scores if right >= 0.9 * len(pairs) and all(r >= 0.9 * len(pairs) for s, r in scores if s >= step)), None)
    last = scores[-1][0]
    print(f"threads={args.threads} seed={args.seed}: 90 % right from step {solid} of {last}" + (f", {last - solid} steps to spare" if solid else ": never"),
          flush=True)


if __name__ == "__main__":
    main()
