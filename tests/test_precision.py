"""The precision policy keeps every update: fp32 master weights, bf16 only in the matmuls.

The seed notebook loaded bf16 weights and let AdamW update them in place; at lr 2e-5 most updates
are smaller than half a bf16 ulp and round away.  These tests train the demo model a few steps
three ways on the same data and compare with an fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from trainer import model as model_module
from trainer import settings

STEPS = 6


def train(demo_assets, weights_dtype: torch.dtype, bf16_compute: bool, tmp_path) -> tuple[float, float]:
    """Return (fraction of weight elements that changed, mean training loss)."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    config = settings.load({"FT_MODEL": str(demo_assets / "model"), "FT_PLATFORM": "none"})
    tokenizer = model_module.load_tokenizer(config)
    net = model_module.load_model(config, tokenizer)  # the job's loader: fp32 master weights
    assert all(p.dtype == torch.float32 for p in net.parameters())
    net = net.to(weights_dtype)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    rows = load_dataset("json", data_files=str(demo_assets / "data" / "train.jsonl"), split="train").select(range(64))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=STEPS, learning_rate=2e-5, warmup_steps=0, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, bf16=bf16_compute, use_cpu=True, report_to=[], save_strategy="no",
                     logging_steps=1, seed=42, disable_tqdm=True, activation_checkpointing=False)
    trainer = SFTTrainer(model=net, args=args, train_dataset=rows, processing_class=tokenizer)
    result = trainer.train()
    changed = sum((p.detach() != before[n]).sum().item() for n, p in net.named_parameters())
    total = sum(p.numel() for p in net.parameters())
    return changed / total, result.training_loss


@pytest.fixture(scope="module")
def fp32_reference(demo_assets, tmp_path_factory):
    return train(demo_assets, torch.float32, False, tmp_path_factory.mktemp("fp32"))


def test_bf16_mixed_moves_essentially_every_weight_and_matches_fp32_loss(demo_assets, fp32_reference, tmp_path):
    changed, loss = train(demo_assets, torch.float32, True, tmp_path)  # FT_PRECISION=bf16-mixed
    assert changed > 0.99
    assert loss == pytest.approx(fp32_reference[1], rel=0.01)


def test_the_seeds_bf16_weights_lose_most_updates(demo_assets, fp32_reference, tmp_path):
    changed, _ = train(demo_assets, torch.bfloat16, True, tmp_path)  # the notebook: dtype=bfloat16 + bf16=True
    assert fp32_reference[0] > 0.99
    assert changed < 0.6, "bf16 weights updated in place lose most of the updates"


def test_auto_precision_is_bf16_mixed_on_a_bf16_gpu_and_fp32_on_cpu():
    config = settings.load({"FT_PLATFORM": "none"})
    assert model_module.resolve_precision(config, cuda=True, bf16_supported=True) == "bf16-mixed"
    assert model_module.resolve_precision(config, cuda=True, bf16_supported=False) == "fp32"
    assert model_module.resolve_precision(config, cuda=False, bf16_supported=False) == "fp32"
