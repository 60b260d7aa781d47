"""How long a stop takes to save: seconds per GB of committed checkpoint on this machine's disk.

    python bench/checkpoint_save.py --out /path/on/the/volume [--hidden 1024 --layers 16]

Trains one step of a random Qwen3 (fp32 weights + AdamW, as the job does), then times the
checkpoint save plus the commit (fsync of every file, then the manifest).  Size the platform's
grace period from this: Qwen3-4B's checkpoint is ~48 GB (fp32 weights + two fp32 AdamW moments).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/fulltune-save-bench")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from trainer.checkpointing.commits import CommitCheckpoints

    shutil.rmtree(args.out, ignore_errors=True)
    config = Qwen3Config(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 128, num_key_value_heads=max(1, args.hidden // 512), head_dim=128)
    model = Qwen3ForCausalLM(config)
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4] * 8] * 4, "labels": [[1, 2, 3, 4] * 8] * 4})

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            self.start = time.perf_counter()

    clock = Clock()
    trainer = Trainer(model=model, train_dataset=rows, callbacks=[clock, CommitCheckpoints(keep=2)],
                      args=TrainingArguments(output_dir=args.out, max_steps=1, save_steps=1, per_device_train_batch_size=1,
                                             report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True))
    trainer.train()
    seconds = time.perf_counter() - clock.start
    folder = os.path.join(args.out, "checkpoint-1")
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs) / 1e9
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"params_m={params:.0f} checkpoint_gb={size:.2f} save_and_commit_s={seconds:.2f} s_per_gb={seconds / size:.2f}")
    print(f"qwen3_4b_estimate: 48.3 GB -> {48.3 * seconds / size:.0f} s on this disk")
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
