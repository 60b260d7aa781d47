"""Padding-free attention: torch's varlen kernel where it checks out, the per-sequence loop everywhere else.

No CUDA here: the kernel is replaced from the test side by a CPU stand-in with varlen_attn's signature (correct,
or deliberately wrong), so the dispatch through transformers, the fallback and the self-check's decision run as
they do on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from trainer.model import attention


def cpu_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, causal_shift=0):
    """varlen_attn's contract on CPU: (tokens, heads, dim) packed sequences, causal when window_size == (-1, 0)."""
    assert isinstance(max_q, int) and max_q == int(cu_seq_q.diff().max())
    if enable_gqa:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.empty_like(query)
    edges = cu_seq_q.tolist()
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        out[a:b] = sdpa(q, k, v, scale=scale, is_causal=tuple(window_size) == (-1, 0) and b - a > 1 and not causal_shift).transpose(0, 1)
    return out


def not_causal(*args, **kwargs):
    """A kernel that gets the mask wrong: every token sees its whole sequence, future included."""
    return cpu_varlen_attn(*args, **kwargs, causal_shift=1)


def wrong_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, **kwargs):
    return cpu_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=(scale or 1.0) * 2, **kwargs)


def raises(*args, **kwargs):
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not chosen yet (the choice is made once per process)."""
    monkeypatch.setattr(attention, "_chosen", {})
    return monkeypatch


def _tiny():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3ForCausalLM(config).eval()


def test_native_path_calls_the_kernel_once_per_layer_on_packed_tensors_and_matches_the_loop(fresh):
    calls = []

    def recording(*args, **kwargs):
        calls.append((args[0].shape, args[3].tolist(), args[5], kwargs["window_size"], kwargs["enable_gqa"]))
        return cpu_varlen_attn(*args, **kwargs)

    fresh.setattr(attention, "kernel", lambda: recording)
    net = _tiny()
    lengths = [5, 12, 1, 9]
    ids = torch.randint(0, 256, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    bounds = torch.tensor([0, 5, 17, 18, 27], dtype=torch.int32)
    batch = dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=12, max_length_k=12, use_cache=False)
    attention.register()
    with torch.no_grad():
        net.set_attn_implementation(attention.NAME)
        loop = net(**batch).logits
        net.set_attn_implementation(attention.NATIVE)
        native = net(**batch).logits
    assert calls == [(torch.Size([27, 4, 16]), [0, 5, 17, 18, 27], 12, (-1, 0), True)] * 2  # one call per layer, causal, GQA
    torch.testing.assert_close(native, loop, rtol=1e-5, atol=1e-5)


def test_on_cpu_the_job_takes_the_loop_without_running_the_kernel(fresh, capsys):
    fresh.setattr(attention, "kernel", raises)
    assert attention.register(cuda=False) == attention.NAME
    assert "attention" not in capsys.readouterr().out  # nothing was checked: nothing to say beyond the plan


def test_a_kernel_that_agrees_is_used_and_said_once(fresh, capsys):
    fresh.setattr(attention, "kernel", lambda: cpu_varlen_attn)
    assert attention.choose("cpu") == (attention.NATIVE, "torch varlen_attn (its self-check against SDPA per sequence passed)")
    assert attention.choose("cpu")[0] == attention.NATIVE
    assert capsys.readouterr().out.count("fulltune: attention: torch varlen_attn") == 1


@pytest.mark.parametrize("wrong", [not_causal, wrong_scale, raises], ids=["not-causal", "wrong-scale", "raises"])
@pytest.mark.faults
def test_a_wrong_or_failing_kernel_falls_back_to_the_loop_and_says_why(fresh, capsys, wrong):
    fresh.setattr(attention, "kernel", lambda: wrong)
    name, why = attention.choose("cpu")
    assert name == attention.NAME
    assert why.startswith("per-sequence SDPA loop: torch varlen_attn")
    if wrong is raises:
        assert "failed its self-check: RuntimeError: FlashAttention only supports Ampere" in why
    else:
        assert "disagreed with SDPA per sequence in its self-check: output off by" in why
    assert f"fulltune: attention: {why}" in capsys.readouterr().out


def test_self_check_tolerance_passes_bf16_rounding_and_fails_a_small_real_error(fresh):
    """bf16 inputs through a correct kernel pass (its error is SDPA's own); the backward alone being wrong fails."""
    fresh.setattr(attention, "kernel", lambda: cpu_varlen_attn)
    assert attention.self_check("cpu", torch.bfloat16) is None

    class WrongBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.05  # 5 % off in the backward only

    fresh.setattr(attention, "kernel", lambda: lambda *a, **k: WrongBackward.apply(cpu_varlen_attn(*a, **k)))
    problem = attention.self_check("cpu", torch.bfloat16)
    assert problem is not None and "query grad off by" in problem, problem
