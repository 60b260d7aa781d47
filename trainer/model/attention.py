"""Attention for padding-free batches: torch's varlen kernel on CUDA once it checks out, else SDPA per sequence.

A padding-free forward pass concatenates its sequences into one row; TRL's collator marks the
boundaries (`cu_seq_lens_q`, `position_ids` restarting at 0).  With `sdpa`, transformers 5.24 turns the
`position_ids` into a block-diagonal mask over the whole row: correct, but the attention then costs
(total length)^2 and SDPA falls back to its masked kernel.  `flash_attention_2` reads the boundaries
directly but needs the flash-attn package.  This implementation runs SDPA once per sequence with
`is_causal=True` (its flash kernel on GPU): the attention costs the sum of each length squared, as
with FlashAttention's varlen kernel, and no mask is built.  Padded batches (evaluation with
`FT_PADDING_FREE=off`) are handled per row the same way.

On CUDA, torch 2.13's `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen kernel on the packed
(tokens, heads, dim) tensors; bf16/fp16, sm80+) does the same in one call, with no `.tolist()` of the boundaries
(a host sync per layer in the loop).  It is new, so the job does not take it on trust: `choose` runs it once at
start on the device against the loop, forward and backward, and uses it (`NATIVE`) only if it agrees; the loop
(`NAME`) stays for CPU and as the fallback.  Either way one log line and the run's `attention` tag say which.

The kernel takes one bf16/fp16 dtype for query, key and value, and has no autocast rule: under bf16-mixed, Qwen3's
query and key come out of its fp32 RMSNorm weights and rotary tables in fp32 while the value comes out of autocast in
bf16, so `varlen_native` casts the three to the autocast dtype first (as transformers' flash integration does), is
chosen only for a bf16/fp16 compute dtype, and the self-check feeds it the job's own dtypes under autocast.

Both paths keep a sliding window (`sliding_window`, Mistral's or Qwen2's `use_sliding_window`): a sequence longer
than the window attends with a banded causal mask in the loop.  Attention logit soft-capping (Gemma 2) and
attention sinks (gpt-oss) are not implemented here: `unsupported` keeps such a model on transformers' own attention.
"""

from __future__ import annotations

from typing import Any

NAME = "fulltune_varlen"  # SDPA per sequence
NATIVE = "fulltune_varlen_native"  # torch.nn.attention.varlen.varlen_attn
_chosen: dict[str, str] = {}  # name and why, once per process: the self-check runs at most once


def varlen_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                **kwargs: Any) -> tuple[Any, None]:
    """query (batch, heads, tokens, dim); key/value (batch, kv heads, tokens, dim) -> (batch, tokens, heads, dim)."""
    import torch

    _refuse_unsupported(kwargs)
    window = kwargs.get("sliding_window")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: repeat the key/value heads (enable_gqa is not on every kernel)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is not None and query.shape[0] == 1:
        edges = bounds.tolist()
        spans = [(0, a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    elif attention_mask is not None:  # right-padded rows: the 2-D mask of real tokens
        lengths = attention_mask.sum(-1).tolist()
        spans = [(row, 0, int(n)) for row, n in enumerate(lengths) if n > 0]
    else:
        return _causal(query, key, value, dropout, scaling, window).transpose(1, 2).contiguous(), None
    out = torch.zeros_like(query)
    for row, a, b in spans:
        out[row : row + 1, :, a:b] = _causal(query[row : row + 1, :, a:b], key[row : row + 1, :, a:b], value[row : row + 1, :, a:b], dropout, scaling, window)
    return out.transpose(1, 2).contiguous(), None


def _causal(query: Any, key: Any, value: Any, dropout: float, scaling: float | None, window: int | None) -> Any:
    """SDPA over one sequence (or rows of equal length): causal, and within the last `window` tokens when the sequence
    is longer (transformers' sliding window: a token sees itself and the `window - 1` before it)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    n = query.shape[2]
    if not window or n <= window:
        return sdpa(query, key, value, dropout_p=dropout, scale=scaling, is_causal=n > 1)
    i = torch.arange(n, device=query.device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # (query, key): allowed
    return sdpa(query, key, value, attn_mask=band, dropout_p=dropout, scale=scaling)


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """Never train silently with other attention than the model's: soft-capped logits and sinks are not implemented."""
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"fulltune's padding-free attention does not implement `{name}`: set FT_PADDING_FREE=off for this model")


def unsupported(net: Any) -> str | None:
    """Why the model needs transformers' own attention (its attention soft-caps its logits or has sinks); else None."""
    text = net.config.get_text_config() if hasattr(net.config, "get_text_config") else net.config
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "its attention soft-caps its logits (attn_logit_softcapping)"
    if any(getattr(m, "sinks", None) is not None for m in net.modules()):
        return "its attention has sinks"
    return None


def kernel() -> Any:
    """torch's varlen attention (its signature: query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale,
    window_size, enable_gqa); tests put a CPU stand-in or a wrong kernel here."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def varlen_native(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[Any, None]:
    """The padding-free row in one kernel call; anything else (padded rows, dropout, a sequence longer than the
    sliding window) through `varlen_sdpa`."""
    _refuse_unsupported(kwargs)
    bounds, window = kwargs.get("cu_seq_lens_q"), kwargs.get("sliding_window")
    if bounds is None or query.shape[0] != 1 or dropout:
        return varlen_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    longest = kwargs.get("max_length_q") or int(bounds.diff().max())  # TRL's collator gives it as an int: no sync
    if window and longest > window:  # the window matters: the loop's banded mask (the self-check covers the causal kernel)
        return varlen_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    q, k, v = in_compute_dtype(*(t[0].transpose(0, 1) for t in (query, key, value)))  # (tokens, heads, dim)
    out = kernel()(q, k, v, bounds, bounds, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])  # (-1, 0): causal
    return out[None], None  # (1, tokens, heads, dim)


def in_compute_dtype(*tensors: Any) -> tuple[Any, ...]:
    """The tensors in autocast's dtype when autocast is on (the kernel has no autocast rule and takes one bf16/fp16
    dtype); else as they are."""
    import torch

    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    target = torch.get_autocast_dtype(device)
    return tuple(t.to(target) for t in tensors)


KERNEL_DEVICES = ("cuda",)  # where torch's varlen kernel runs; tests add "cpu" with a stand-in in `kernel()`
HALF = ("bfloat16", "float16")  # the kernel's dtypes (FlashAttention)


def register(device: str = "cpu", precision: Any = None) -> str:
    """Make `NAME` and `NATIVE` attention implementations transformers can dispatch to; returns the one to use:
    `NATIVE` only on a device the kernel runs on, for a precision that computes in bf16/fp16 (trainer/core/config.py's
    `Precision`: never FT_PRECISION=fp32), once its self-check passed (`choose`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    for name, function in ((NAME, varlen_sdpa), (NATIVE, varlen_native)):
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)  # None, or the 2-D mask of real tokens
    if device not in KERNEL_DEVICES or precision is None or precision.compute_dtype not in HALF:
        return NAME
    return choose(device, precision)[0]


def choose(device: str = "cuda", precision: Any = None) -> tuple[str, str]:
    """The attention to use on `device` and why, decided once per process and said in one log line.  `precision`:
    the job's (its weights' and compute dtypes are what the self-check feeds the kernel); None: bf16-mixed's."""
    if not _chosen:
        import torch

        dtypes = (getattr(torch, precision.compute_dtype), getattr(torch, precision.weight_dtype)) if precision is not None else ()
        problem = self_check(device, *dtypes)
        name = NAME if problem else NATIVE
        why = f"per-sequence SDPA loop: torch varlen_attn {problem}" if problem else "torch varlen_attn (its self-check against SDPA per sequence passed)"
        _chosen.update(name=name, why=why)
        print(f"fulltune: attention: {why}", flush=True)
    return _chosen["name"], _chosen["why"]


def decided() -> str | None:
    """Why this process uses the attention it does, once `choose` (or `prefer_loop`) decided; else None (CPU)."""
    return _chosen.get("why")


def prefer_loop(why: str) -> None:
    """Take the loop whatever the kernel would do (the benchmark's loop variant, to compare the two on one card)."""
    _chosen.update(name=NAME, why=f"per-sequence SDPA loop ({why})")


def path_taken(net: Any) -> str:
    """What the model's attention is, for the run's `attention` tag."""
    name = net.config._attn_implementation
    return {NAME: "per-sequence SDPA loop", NATIVE: "torch varlen_attn"}.get(name, name)


SELF_CHECK_LENGTHS = (1, 7, 64, 129, 300)  # one token, odd sizes, longer than a kernel tile
SELF_CHECK_HEADS, SELF_CHECK_KV_HEADS, SELF_CHECK_DIM = 8, 2, 128  # Qwen3's head dim, grouped-query like Qwen3


def self_check(device: str, dtype: Any = None, stream: Any = None, seed: int = 0) -> str | None:
    """None when `kernel()` agrees with the per-sequence loop on a small random packed batch, forward and backward
    (outputs and the gradients of query, key and value); else what went wrong.

    The reference is the loop in fp32.  The kernel runs through `varlen_native` as training runs it: under autocast to
    `dtype` (bf16 by default), with query and key in `stream`, the weights' dtype (fp32 by default: bf16-mixed's RMSNorm
    and rotary tables make them fp32) and value in `dtype` (a projection's output under autocast); so a kernel that
    cannot take the job's dtypes falls back to the loop here instead of failing the first step.  It passes when each
    of its relative errors is at most twice the loop's own in `dtype`, plus 1e-3: bf16's tolerance as SDPA itself
    shows it, so a kernel that is as exact as SDPA passes on any card and a wrong one (not causal, wrong scale,
    boundaries ignored) fails by orders of magnitude."""
    import contextlib

    import torch

    dtype, stream = dtype or torch.bfloat16, stream or torch.float32
    try:
        generator = torch.Generator().manual_seed(seed)
        tokens = sum(SELF_CHECK_LENGTHS)
        bounds = torch.tensor([0, *torch.tensor(SELF_CHECK_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
        shapes = ((1, SELF_CHECK_HEADS, tokens, SELF_CHECK_DIM), (1, SELF_CHECK_KV_HEADS, tokens, SELF_CHECK_DIM),
                  (1, SELF_CHECK_KV_HEADS, tokens, SELF_CHECK_DIM))
        inputs = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
        grad = torch.randn((1, tokens, SELF_CHECK_HEADS, SELF_CHECK_DIM), generator=generator).to(device)
        kwargs = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(SELF_CHECK_LENGTHS), "max_length_k": max(SELF_CHECK_LENGTHS)}

        def run(function: Any, dtypes: tuple[Any, Any, Any], autocast: bool = False) -> list[Any]:
            leaves = [t.detach().to(d).clone().requires_grad_() for t, d in zip(inputs, dtypes, strict=True)]
            with torch.autocast(device, dtype) if autocast else contextlib.nullcontext():
                out, _ = function(None, *leaves, None, scaling=SELF_CHECK_DIM**-0.5, **kwargs)
            out.backward(grad.to(out.dtype))
            return [out.detach().float()] + [leaf.grad.float() for leaf in leaves]

        reference, loop = run(varlen_sdpa, (torch.float32,) * 3), run(varlen_sdpa, (dtype,) * 3)
        native = run(varlen_native, (stream, stream, dtype), autocast=True)
    except Exception as error:  # noqa: BLE001 - any failure of the kernel (an older GPU, a missing build) means the loop
        return f"failed its self-check: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
    for what, ref, mine, theirs in zip(("output", "query grad", "key grad", "value grad"), reference, loop, native, strict=True):
        scale = ref.abs().max().clamp_min(1e-12)
        loop_error, native_error = float((mine - ref).abs().max() / scale), float((theirs - ref).abs().max() / scale)
        if not native_error <= 2 * loop_error + 1e-3:
            return f"disagreed with SDPA per sequence in its self-check: {what} off by {native_error:.2g} relative (SDPA's own {dtype}: {loop_error:.2g})"
    return None
