"""Padding-free attention: torch's varlen kernel where it checks out, the per-sequence loop everywhere else.

No CUDA here: the kernel is replaced from the test side by a CPU stand-in with varlen_attn's signature (correct,
or deliberately wrong), so the dispatch through transformers, the fallback and the self-check's decision run as
they do on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from trainer.core.config import PRECISIONS
from trainer.model import attention


def cpu_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, causal_shift=0):
    """varlen_attn's contract on CPU: (tokens, heads, dim) packed sequences, causal when window_size == (-1, 0).
    Any dtype (see `strict`)."""
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


def strict(query, key, value, *args, **kwargs):
    """As FlashAttention checks its inputs (flash_api.cpp): one dtype for query, key and value, and that one fp16 or bf16."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise RuntimeError("query and key must have the same dtype")
    return cpu_varlen_attn(query, key, value, *args, **kwargs)


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
    assert attention.register("cpu", PRECISIONS["bf16-mixed"]) == attention.NAME
    assert "attention" not in capsys.readouterr().out  # nothing was checked: nothing to say beyond the plan


def test_an_fp32_job_never_takes_the_bf16_kernel_even_where_it_runs(fresh):
    """FT_PRECISION=fp32 on a bf16 GPU: fp32 query, key and value would reach a bf16/fp16-only kernel."""
    calls = []
    fresh.setattr(attention, "KERNEL_DEVICES", ("cpu",))  # the stand-in runs here, as torch's kernel does on CUDA
    fresh.setattr(attention, "kernel", lambda: lambda *a, **k: calls.append(1) or cpu_varlen_attn(*a, **k))
    assert attention.register("cpu", PRECISIONS["fp32"]) == attention.NAME and not calls  # not even checked
    assert attention.register("cpu", PRECISIONS["bf16-mixed"]) == attention.NATIVE and calls


def _packed_batch(lengths, vocab=256):
    """A training batch as the job's collator builds it: TRL's padding-free collator over tokenized rows."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    generator = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(1, vocab, (n,), generator=generator).tolist()} for n in lengths]
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)


def test_the_default_jobs_mixed_dtypes_reach_a_strict_kernel_as_one_bf16_dtype_forward_and_backward(fresh):
    """bf16-mixed: fp32 weights under bf16 autocast give the attention fp32 query and key (Qwen3's fp32 RMSNorm
    weights and rotary tables) and a bf16 value; FlashAttention refuses that, so the native path casts to the autocast
    dtype.  A real forward and backward of a tiny fp32 Qwen3 on a padding-free batch, against the loop."""
    seen = []

    def recording(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return strict(query, key, value, *args, **kwargs)

    fresh.setattr(attention, "kernel", lambda: recording)
    batch = _packed_batch([9, 30, 1, 17])
    attention.register()
    results = {}
    for name in (attention.NATIVE, attention.NAME):
        net = _tiny().train()
        net.set_attn_implementation(name)
        with torch.autocast("cpu", torch.bfloat16):
            loss = net(**batch, use_cache=False).loss
        loss.backward()
        results[name] = (loss.detach(), net.model.layers[0].self_attn.q_proj.weight.grad)
    assert seen == [(torch.bfloat16,) * 3] * 2  # once per layer, one dtype
    (native_loss, native_grad), (loop_loss, loop_grad) = results[attention.NATIVE], results[attention.NAME]
    torch.testing.assert_close(native_loss, loop_loss, rtol=1e-2, atol=1e-2)  # bf16 both ways
    assert float((native_grad - loop_grad).abs().max() / loop_grad.abs().max()) < 0.05


def test_the_self_check_runs_the_jobs_own_dtypes_under_autocast_so_a_dtype_problem_falls_back_at_start(fresh, capsys):
    """A native path that handed the kernel the job's mixed dtypes as they come (the cast undone here) passes a check
    on all-bf16 tensors and crashes at step 1; the check under autocast with fp32 query and key falls back instead."""
    fresh.setattr(attention, "kernel", lambda: strict)
    assert attention.self_check("cpu") is None  # with the cast: passes
    fresh.setattr(attention, "in_compute_dtype", lambda *tensors: tensors, raising=False)
    name, why = attention.choose("cpu", PRECISIONS["bf16-mixed"])
    assert name == attention.NAME, why
    assert "failed its self-check: RuntimeError: FlashAttention only support fp16 and bf16 data type" in why


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


def test_the_jobs_own_trainer_trains_bf16_mixed_through_a_strict_kernel(fresh, demo_assets, tmp_path):
    """build_trainer as the job calls it (recipe, TRL's padding-free collator, accelerate's bf16 autocast: on CPU here),
    with the strict stand-in where torch's kernel is looked up: two optimizer steps, every layer through the kernel."""
    from trainer import sft_trainer
    from trainer.core import settings as settings_table
    from trainer.core.config import Config
    from trainer.data import prepare as data
    from trainer.model import loading, memory

    calls = []
    fresh.setattr(attention, "KERNEL_DEVICES", ("cpu",))
    fresh.setattr(attention, "kernel", lambda: lambda *a, **k: calls.append(a[0].dtype) or strict(*a, **k))
    settings = settings_table.load({
        "FT_MODEL": str(demo_assets / "model"), "FT_DATASET": str(demo_assets / "data" / "train.jsonl"), "FT_OUTPUT_DIR": str(tmp_path / "out"),
        "FT_PLATFORM": "none", "FT_MAX_STEPS": "2", "FT_SAVE_STEPS": "10", "FT_EVAL_STEPS": "10", "FT_EVAL_SAMPLES": "0", "FT_EVAL_FRACTION": "0",
    })  # fmt: skip
    config = Config(settings, cuda=False, precision=PRECISIONS["bf16-mixed"])  # what a bf16 GPU resolves `auto` to
    tokenizer = loading.load_tokenizer(settings)
    prepared = data.prepare(settings, tokenizer)
    plan = memory.plan(loading.read_config(settings), 10**6, settings, config.precision, 0.0, "off")
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan)
    assert trainer.model.config._attn_implementation == attention.NATIVE and trainer.args.bf16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    trainer.train()
    assert trainer.state.global_step == 2 and len(calls) >= 2 * trainer.model.config.num_hidden_layers
    assert set(calls) == {torch.bfloat16}


def _windowed(kind: str):
    """A tiny model whose layers attend within a sliding window of 5 tokens (shorter than most sequences here)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen2":  # Qwen2's use_sliding_window: layers from max_window_layers on are sliding (here the second)
        config = Qwen2Config(**sizes, use_sliding_window=True, sliding_window=5, max_window_layers=1)
        assert config.layer_types == ["full_attention", "sliding_attention"]
        return Qwen2ForCausalLM(config).eval()
    return MistralForCausalLM(MistralConfig(**sizes, head_dim=16, sliding_window=5)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_a_sliding_window_is_kept_by_both_paths_as_transformers_sdpa_keeps_it(fresh, kind):
    """Each sequence alone through transformers' sdpa (its sliding-window mask) against the packed row through the
    loop and through the native path: a window ignored would let tokens past the 5th see the whole sequence."""
    fresh.setattr(attention, "kernel", lambda: cpu_varlen_attn)
    net = _windowed(kind)
    lengths = [12, 3, 20, 5, 6]
    batch = _packed_batch(lengths)
    ids = batch["input_ids"][0]
    with torch.no_grad():
        alone = torch.cat([net(input_ids=s[None], use_cache=False).logits[0] for s in ids.split(lengths)])
        attention.register()
        for name in (attention.NAME, attention.NATIVE):
            net.set_attn_implementation(name)
            packed = net(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
            torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.faults("a model whose attention soft-caps its logits")
def test_a_model_whose_attention_soft_caps_its_logits_keeps_transformers_own_attention(capsys):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from trainer.core import settings as settings_table
    from trainer.model import recipe

    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, attn_logit_softcapping=50.0)
    net = Gemma2ForCausalLM(config)
    own = net.config._attn_implementation
    prepared = recipe.prepare_model(net, settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused"}), cuda=True, precision=PRECISIONS["bf16-mixed"])
    assert prepared.config._attn_implementation == own != attention.NAME
    assert "soft-caps its logits" in capsys.readouterr().out
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(NotImplementedError, match="FT_PADDING_FREE=off"):  # never silently without the cap
        attention.varlen_sdpa(None, q, q, q, None, softcap=50.0)
