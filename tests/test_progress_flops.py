"""MFU's FLOPs per token (console/progress.py) against torch's FlopCounterMode on a real training step.

The convention: model FLOPs, no recomputation.  The plain step (matmul attention, the model's own loss, no
activation checkpointing) counts exactly that; the job's step counts more, by what it recomputes.
"""

from __future__ import annotations

import pytest

from trainer.console import progress
from trainer.model import estimate


def _counted(config, length, **forward):
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    net = Qwen3ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, length))
    with FlopCounterMode(display=False) as counted:
        net(input_ids=ids, labels=ids, use_cache=False, **forward).loss.backward()
    return counted.get_total_flops() / length, estimate.parameter_count(config)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_is_what_flop_counter_mode_counts_for_a_step_without_recomputation(tied):
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=tied
    )
    config._attn_implementation = "eager"  # its matmuls, all S x S scores, are what FlopCounterMode sees
    counted, n = _counted(config, 512)
    assert progress.flops_per_token(config, n, 512) == pytest.approx(counted, rel=0.01)
    assert progress.flops_per_token(config, n, 1024) > progress.flops_per_token(config, n, 512)  # attention grows with S
