"""How much of an AdamW update survives when it is written into bf16 weights: torch's round-to-nearest
(the seed notebook: bf16 weights updated in place) against fp32 master weights and FT_PRECISION=bf16-sr.

    .venv/bin/python bench/bf16_rounding.py [--steps 6] [--lr 2e-5] [--eval-steps 30 --eval-lr 2e-4]

Trains the demo model (trainer/data/demo.py) on the same rows each way, 8 sequences a step (4 x 2 passes), and
prints per policy: the share of weight elements that changed at all, how much of the fp32 run's update was
applied ("kept": the run's weight change projected on the fp32 run's, divided by its squared norm; 1 = all)
and the mean training loss against fp32.  With --eval-steps, also the eval loss on 128 held-out rows after a
longer run at a larger learning rate.  This characterises torch's bf16 rounding, which is why fulltune keeps
fp32 master weights (bf16-mixed) or rounds stochastically (bf16-sr); tests/test_precision.py tests those two.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

POLICIES = {  # name: (weights dtype, bf16 autocast, stochastic rounding)
    "fp32": ("float32", False, False),
    "bf16-mixed (fp32 master)": ("float32", True, False),
    "notebook: bf16 weights, round-to-nearest": ("bfloat16", True, False),
    "bf16-sr": ("bfloat16", True, True),
}


def train(demo_dir: str, policy: tuple[str, bool, bool], steps: int, lr: float, evaluate: bool, out: str):
    """(fraction of elements changed, mean training loss, every weight's change in fp32), or the eval loss."""
    import torch
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from trainer.core import settings
    from trainer.model import loading as model_module
    from trainer.model import recipe

    dtype, bf16_compute, sr = policy
    config = settings.load({"FT_MODEL": os.path.join(demo_dir, "model"), "FT_PLATFORM": "none"} | ({"FT_PRECISION": "bf16-sr"} if sr else {}))
    tokenizer = model_module.load_tokenizer(config)
    net = model_module.load_model(config, tokenizer).to(getattr(torch, dtype))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    rows = load_dataset("json", data_files=os.path.join(demo_dir, "data", "train.jsonl"), split="train")
    args = SFTConfig(output_dir=out, max_steps=steps, learning_rate=lr, warmup_steps=0, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                     bf16=bf16_compute, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=42, disable_tqdm=True,
                     activation_checkpointing=False)
    trainer = SFTTrainer(model=net, args=args, train_dataset=rows.select(range(8 * steps)), processing_class=tokenizer,
                         optimizer_cls_and_kwargs=recipe.optimizer_cls_and_kwargs("bf16-sr" if sr else "fp32", args))
    result = trainer.train()
    if evaluate:
        return trainer.evaluate(eval_dataset=rows.select(range(1000, 1128)))["eval_loss"]
    changed = sum((p.detach() != before[n]).sum().item() for n, p in net.named_parameters()) / sum(p.numel() for p in net.parameters())
    delta = torch.cat([(p.detach().float() - before[n].float()).flatten() for n, p in net.named_parameters()])
    return changed, result.training_loss, delta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--eval-steps", type=int, default=0, help="also train this many steps at --eval-lr and print the eval loss (0: skip)")
    parser.add_argument("--eval-lr", type=float, default=2e-4)
    args = parser.parse_args()

    from trainer.data import demo

    work = tempfile.mkdtemp(prefix="fulltune-bf16-rounding-")
    demo_dir = demo.ensure_demo(work)
    runs = {name: train(demo_dir, policy, args.steps, args.lr, False, os.path.join(work, str(i))) for i, (name, policy) in enumerate(POLICIES.items())}
    _, reference_loss, reference = runs["fp32"]
    print(f"\ndemo model, {args.steps} steps at lr {args.lr:g}, 8 sequences a step")
    print("| | elements changed | update kept | training loss vs fp32 |\n|---|---|---|---|")
    for name, (changed, loss, delta) in runs.items():
        kept = (delta @ reference / (reference @ reference)).item()
        print(f"| {name} | {changed:.1%} | {kept:.3f} | {loss / reference_loss - 1:+.2%} |")
    if args.eval_steps:
        print(f"\neval loss after {args.eval_steps} steps at lr {args.eval_lr:g}")
        for i, (name, policy) in enumerate(POLICIES.items()):
            print(f"| {name} | {train(demo_dir, policy, args.eval_steps, args.eval_lr, True, os.path.join(work, f'eval-{i}')):.4f} |")


if __name__ == "__main__":
    main()
