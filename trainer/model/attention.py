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
    from torch.nn.functional import scaled_dot_product_attention as sdpa

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
        out = sdpa(query, key, value, dropout_p=dropout, scale=scaling, is_causal=query.shape[2] > 1)
        return out.transpose(1, 2).contiguous(), None
    out = torch.zeros_like(query)
    for row, a, b in spans:
        out[row : row + 1, :, a:b] = sdpa(query[row : row + 1, :, a:b], key[row : row + 1, :, a:b], value[row : row + 1, :, a:b],
                                          dropout_p=dropout, scale=scaling, is_causal=b - a > 1)
    return out.transpose(1, 2).contiguous(), None


def kernel() -> Any:
    """torch's varlen attention (its signature: query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale,
    window_size, enable_gqa); tests put a CPU stand-in or a wrong kernel here."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def varlen_native(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[Any, None]:
    """The padding-free row in one kernel call; anything else (padded rows, dropout) through `varlen_sdpa`."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1 or dropout:
        return varlen_sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    longest = kwargs.get("max_length_q") or int(bounds.diff().max())  # TRL's collator gives it as an int: no sync
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    out = kernel()(q, k, v, bounds, bounds, longest, longest, scale=scaling, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])  # (-1, 0): causal
    return out[None], None  # (1, tokens, heads, dim)


def register(cuda: bool = False) -> str:
    """Make `NAME` and `NATIVE` attention implementations transformers can dispatch to; returns the one to use
    (`NATIVE` only on CUDA, once its self-check passed: `choose`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    for name, function in ((NAME, varlen_sdpa), (NATIVE, varlen_native)):
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)  # None, or the 2-D mask of real tokens
    return choose()[0] if cuda else NAME


def choose(device: str = "cuda") -> tuple[str, str]:
    """The attention to use on `device` and why, decided once per process and said in one log line."""
    if not _chosen:
        problem = self_check(device)
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


def self_check(device: str, dtype: Any = None, seed: int = 0) -> str | None:
    """None when `kernel()` agrees with the per-sequence loop on a small random packed batch, forward and backward
    (outputs and the gradients of query, key and value); else what went wrong.

    The reference is the loop in fp32.  The kernel runs in `dtype` (bf16 by default) and passes when each of its
    relative errors is at most twice the loop's own in `dtype`, plus 1e-3: bf16's tolerance as SDPA itself
    shows it, so a kernel that is as exact as SDPA passes on any card and a wrong one (not causal, wrong scale,
    boundaries ignored) fails by orders of magnitude."""
    import torch

    dtype = dtype or torch.bfloat16
    try:
        generator = torch.Generator().manual_seed(seed)
        tokens = sum(SELF_CHECK_LENGTHS)
        bounds = torch.tensor([0, *torch.tensor(SELF_CHECK_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
        shapes = ((1, SELF_CHECK_HEADS, tokens, SELF_CHECK_DIM), (1, SELF_CHECK_KV_HEADS, tokens, SELF_CHECK_DIM),
                  (1, SELF_CHECK_KV_HEADS, tokens, SELF_CHECK_DIM))
        inputs = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
        grad = torch.randn((1, tokens, SELF_CHECK_HEADS, SELF_CHECK_DIM), generator=generator).to(device)
        kwargs = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(SELF_CHECK_LENGTHS), "max_length_k": max(SELF_CHECK_LENGTHS)}

        def run(function: Any, as_dtype: Any) -> list[Any]:
            leaves = [t.detach().to(as_dtype).clone().requires_grad_() for t in inputs]
            out, _ = function(None, *leaves, None, scaling=SELF_CHECK_DIM**-0.5, **kwargs)
            out.backward(grad.to(as_dtype))
            return [out.detach().float()] + [leaf.grad.float() for leaf in leaves]

        reference, loop, native = run(varlen_sdpa, torch.float32), run(varlen_sdpa, dtype), run(varlen_native, dtype)
    except Exception as error:  # noqa: BLE001 - any failure of the kernel (an older GPU, a missing build) means the loop
        return f"failed its self-check: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
    for what, ref, mine, theirs in zip(("output", "query grad", "key grad", "value grad"), reference, loop, native, strict=True):
        scale = ref.abs().max().clamp_min(1e-12)
        loop_error, native_error = float((mine - ref).abs().max() / scale), float((theirs - ref).abs().max() / scale)
        if not native_error <= 2 * loop_error + 1e-3:
            return f"disagreed with SDPA per sequence in its self-check: {what} off by {native_error:.2g} relative (SDPA's own {dtype}: {loop_error:.2g})"
    return None
