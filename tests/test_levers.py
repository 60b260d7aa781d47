"""Throughput levers change the speed, not the math."""

from __future__ import annotations

import pytest

from trainer import recipe
from trainer import settings as settings_table
from trainer.memory import Plan


def _tiny_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    return Qwen3ForCausalLM(config).eval()


def test_per_sequence_attention_matches_sdpa_on_padding_free_and_padded_batches():
    import torch

    from trainer import attention

    net = _tiny_model()
    lengths = [30, 50, 17]
    seqs = [torch.randint(0, 512, (n,)) for n in lengths]
    with torch.no_grad():
        reference = torch.cat([net(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        net.set_attn_implementation(attention.register())
        bounds = torch.tensor([0, 30, 80, 97], dtype=torch.int32)
        flat = net(input_ids=torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(n) for n in lengths])[None], use_cache=False, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds).logits[0]
        ids, mask = torch.zeros(3, 50, dtype=torch.long), torch.zeros(3, 50, dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s)], mask[row, : len(s)] = s, 1
        padded = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(flat, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([padded[row, :n] for row, n in enumerate(lengths)]), reference, rtol=1e-4, atol=1e-4)


def test_auto_optimizer_is_fused_adamw_on_gpu_and_the_loop_on_cpu_unless_set():
    """FT_OPTIMIZER=auto depends on the device; an explicit value is used on every device."""
    plan = Plan(1, 8, 0, {}, 0.0)
    auto = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused"})
    assert recipe.sft_config(auto, "fp32", plan, cuda=True).optim == "adamw_torch_fused"
    assert recipe.sft_config(auto, "fp32", plan, cuda=False).optim == "adamw_torch"
    for name in ("adamw_torch", "adamw_torch_fused"):
        explicit = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused", "FT_OPTIMIZER": name})
        assert recipe.sft_config(explicit, "fp32", plan, cuda=True).optim == name
        assert recipe.sft_config(explicit, "fp32", plan, cuda=False).optim == name


def test_padding_free_passes_are_on_for_every_device_unless_turned_off():
    """FT_PADDING_FREE=auto does not depend on the device (measured faster on CPU; GPU pending, trainer/recipe.py):
    TRL's padding-free collator and the per-sequence attention on CPU and GPU alike; `off` is TRL's padded default."""
    from trainer import attention, demo

    tokenizer = demo.build_tokenizer(["abc def"] * 10)
    for cuda in (False, True):
        on = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused"})
        assert recipe.collator(on, tokenizer, cuda).padding_free
        assert recipe.prepare_model(_tiny_model(), on, cuda).config._attn_implementation == attention.register()
        off = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused", "FT_PADDING_FREE": "off"})
        assert recipe.collator(off, tokenizer, cuda) is None
        assert recipe.prepare_model(_tiny_model(), off, cuda).config._attn_implementation == "sdpa"


def test_regrouped_passes_keep_the_sequences_per_step_and_the_recipe():
    pytest.importorskip("trl")
    from trainer.memory import Plan

    settings = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused", "FT_EVAL_MAX_SAMPLES": "3"})
    config = recipe.sft_config(settings, "fp32", Plan(8, 1, 0, {}, 0.0), cuda=False)
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == settings.batch_size * settings.gradient_accumulation_steps
    assert config.per_device_eval_batch_size == 8 and config.learning_rate == 2e-5 and not config.activation_checkpointing
    from datasets import Dataset

    assert len(recipe.eval_rows(settings, Dataset.from_dict({"x": list(range(10))}))) == 3


def test_selective_recomputation_recomputes_the_planned_layers_and_keeps_the_loss(tmp_path):
    """FT_ACTIVATION_CHECKPOINTING=selective: the plan's every-n-th layers recompute; the losses are unchanged."""
    pytest.importorskip("trl")
    import torch
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl import SFTTrainer

    from trainer import demo
    from trainer.memory import Plan

    tokenizer = demo.build_tokenizer(["abc def"] * 10)
    settings = settings_table.load({"FT_OUTPUT_DIR": str(tmp_path), "FT_MAX_STEPS": "3", "FT_LOGGING_STEPS": "1", "FT_WARMUP_STEPS": "0", "FT_LEARNING_RATE": "1e-3"})
    generator = torch.Generator().manual_seed(0)
    rows = Dataset.from_dict({"input_ids": [torch.randint(3, len(tokenizer), (int(n),), generator=generator).tolist() for n in torch.randint(8, 40, (24,), generator=generator)]})

    def train(every: int) -> tuple[list[float], list[bool]]:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=tokenizer.pad_token_id)
        net = recipe.prepare_model(Qwen3ForCausalLM(config), settings, cuda=False)
        args = recipe.sft_config(settings, "fp32", Plan(8, 1, every, {}, 0.0), cuda=False)
        args.report_to = []  # no MLflow run for this check
        trainer = SFTTrainer(model=net, args=args, train_dataset=rows, eval_dataset=rows.select(range(4)), processing_class=tokenizer, data_collator=recipe.collator(settings, tokenizer, cuda=False))
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, [layer.gradient_checkpointing for layer in net.model.layers]

    kept, no_flags = train(0)
    recomputed, flags = train(2)
    assert no_flags == [False] * 4
    assert flags == [True, False, True, False]  # every 2nd layer, from the first, as the memory plan counts them
    assert len(kept) == 3 and recomputed == pytest.approx(kept, rel=1e-5)
