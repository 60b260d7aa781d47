"""The precision policies keep the updates: fp32 master weights, or bf16 weights with stochastic rounding.

The seed notebook loaded bf16 weights and let AdamW update them in place; at lr 2e-5 most updates
are smaller than half a bf16 ulp and round away (torch's rounding, not fulltune's: bench/bf16_rounding.py
prints how much).  These tests train the demo model a few steps with fulltune's policies on the same data
and compare with an fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from trainer.core import settings
from trainer.core.config import PRECISIONS, resolve_precision
from trainer.core.errors import ConfigError
from trainer.model import loading as model_module
from trainer.model import recipe

STEPS = 6


def train(demo_assets, weights_dtype: torch.dtype, bf16_compute: bool, tmp_path, *, sr: bool = False, steps: int = STEPS,
          lr: float = 2e-5, evaluate: bool = False) -> tuple[float, float, torch.Tensor]:
    """Return (fraction of weight elements that changed, mean training loss, every weight's change in fp32),
    or the eval loss with `evaluate`.

    `sr`: FT_PRECISION=bf16-sr as the job wires it (bf16 weights from load_model, trainer/model/optim.py's AdamW).
    """
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    config = settings.load({"FT_MODEL": str(demo_assets / "model"), "FT_PLATFORM": "none"} | ({"FT_PRECISION": "bf16-sr"} if sr else {}))
    tokenizer = model_module.load_tokenizer(config)
    net = model_module.load_model(config, tokenizer, PRECISIONS["bf16-sr" if sr else "fp32"])  # the job's loader: fp32 master weights, bf16 with bf16-sr
    assert all(p.dtype == (torch.bfloat16 if sr else torch.float32) for p in net.parameters())
    net = net.to(weights_dtype)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    rows = load_dataset("json", data_files=str(demo_assets / "data" / "train.jsonl"), split="train")
    args = SFTConfig(output_dir=str(tmp_path), max_steps=steps, learning_rate=lr, warmup_steps=0, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, bf16=bf16_compute, use_cpu=True, report_to=[], save_strategy="no",
                     logging_steps=1, seed=42, disable_tqdm=True, activation_checkpointing=False)
    trainer = SFTTrainer(model=net, args=args, train_dataset=rows.select(range(8 * steps)), processing_class=tokenizer,
                         optimizer_cls_and_kwargs=recipe.optimizer_cls_and_kwargs(PRECISIONS["bf16-sr" if sr else "fp32"], args))
    result = trainer.train()
    if evaluate:
        return trainer.evaluate(eval_dataset=rows.select(range(1000, 1128)))["eval_loss"]
    changed = sum((p.detach() != before[n]).sum().item() for n, p in net.named_parameters())
    total = sum(p.numel() for p in net.parameters())
    delta = torch.cat([(p.detach().float() - before[n].float()).flatten() for n, p in net.named_parameters()])
    return changed / total, result.training_loss, delta


def kept(delta: torch.Tensor, reference: torch.Tensor) -> float:
    """How much of the fp32 reference's update a run applied: its change projected on the reference's (1 = all)."""
    return (delta @ reference / (reference @ reference)).item()


@pytest.fixture(scope="module")
def fp32_reference(demo_assets, tmp_path_factory):
    return train(demo_assets, torch.float32, False, tmp_path_factory.mktemp("fp32"))


def test_bf16_mixed_moves_essentially_every_weight_and_matches_fp32_loss(demo_assets, fp32_reference, tmp_path):
    changed, loss, _ = train(demo_assets, torch.float32, True, tmp_path)  # FT_PRECISION=bf16-mixed
    assert changed > 0.99
    assert loss == pytest.approx(fp32_reference[1], rel=0.01)


def test_auto_precision_is_bf16_mixed_on_a_bf16_gpu_and_fp32_on_cpu():
    config = settings.load({"FT_PLATFORM": "none"})
    assert resolve_precision(config.precision, cuda=True, bf16_supported=True).name == "bf16-mixed"
    assert resolve_precision(config.precision, cuda=True, bf16_supported=False).name == "fp32"
    assert resolve_precision(config.precision, cuda=False, bf16_supported=False).name == "fp32"


def test_bf16_sr_moves_essentially_every_bf16_weight_and_matches_fp32_loss(demo_assets, fp32_reference, tmp_path):
    changed, loss, delta = train(demo_assets, torch.bfloat16, True, tmp_path, sr=True)  # FT_PRECISION=bf16-sr
    print(f"bf16-sr: {changed:.3f} of the weights changed, {kept(delta, fp32_reference[2]):.4f} of the update kept, "
          f"loss {(loss / fp32_reference[1] - 1) * 100:+.4f} % vs fp32")
    assert changed > 0.5, "an element whose update is a fraction f of a bf16 ulp moves with probability f: not all move in 6 steps"
    assert kept(delta, fp32_reference[2]) == pytest.approx(1, abs=0.1), "stochastic rounding keeps the updates in expectation"
    assert loss == pytest.approx(fp32_reference[1], rel=0.01)


@pytest.mark.slow  # 60 training steps with bf16 on CPU
def test_bf16_sr_eval_loss_after_30_steps_matches_fp32_master_weights(demo_assets, tmp_path):
    mixed = train(demo_assets, torch.float32, True, tmp_path / "mixed", steps=30, lr=2e-4, evaluate=True)  # bf16-mixed
    rounded = train(demo_assets, torch.bfloat16, True, tmp_path / "sr", sr=True, steps=30, lr=2e-4, evaluate=True)
    print(f"eval loss after 30 steps at lr 2e-4: bf16-sr {rounded:.4f}, bf16-mixed {mixed:.4f}")
    assert rounded == pytest.approx(mixed, rel=0.01)  # measured -0.05 %; the seed's bf16 weights: +1.5 %


def test_bf16_sr_resumed_job_computes_the_same_weights_as_an_uninterrupted_one(demo_assets, tmp_path):
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    config = settings.load({"FT_MODEL": str(demo_assets / "model"), "FT_PLATFORM": "none", "FT_PRECISION": "bf16-sr"})
    tokenizer = model_module.load_tokenizer(config)
    rows = load_dataset("json", data_files=str(demo_assets / "data" / "train.jsonl"), split="train").select(range(32))

    def trainer(folder):
        args = SFTConfig(output_dir=str(tmp_path / folder), max_steps=4, learning_rate=1e-4, warmup_steps=0, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, bf16=True, use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
                         logging_steps=1, seed=42, disable_tqdm=True, activation_checkpointing=False)
        return SFTTrainer(model=model_module.load_model(config, tokenizer, PRECISIONS["bf16-sr"]), args=args, train_dataset=rows, processing_class=tokenizer,
                          optimizer_cls_and_kwargs=recipe.optimizer_cls_and_kwargs(PRECISIONS["bf16-sr"], args))

    straight = trainer("straight")
    straight.train()  # 4 steps, leaving checkpoint-2 behind as an interrupted job would
    saved = torch.load(tmp_path / "straight" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert set(saved) == {"state", "param_groups"}  # all DCP keeps of an optimizer under FSDP: the rounding's bits need nothing more
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in saved["state"].values())
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))  # steps 3 and 4 again
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b), name


def test_bf16_sr_is_opt_in_and_runs_on_cpu_only_when_asked():
    config = settings.load({"FT_PLATFORM": "none", "FT_PRECISION": "bf16-sr"})
    assert resolve_precision(config.precision, cuda=False, bf16_supported=False).name == "bf16-sr"
    assert resolve_precision(config.precision, cuda=True, bf16_supported=True).name == "bf16-sr"
    with pytest.raises(ConfigError, match="FT_PRECISION=bf16-sr needs a GPU with bf16"):
        resolve_precision(config.precision, cuda=True, bf16_supported=False)
