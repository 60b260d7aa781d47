"""Per-sequence attention for padding-free batches, without FlashAttention.

A padding-free forward pass concatenates its sequences into one row; TRL's collator marks the
boundaries (`cu_seq_lens_q`, `position_ids` restarting at 0).  With `sdpa`, transformers 5.24 turns the
`position_ids` into a block-diagonal mask over the whole row: correct, but the attention then costs
(total length)^2 and SDPA falls back to its masked kernel.  `flash_attention_2` reads the boundaries
directly but needs the flash-attn package.  This implementation runs SDPA once per sequence with
`is_causal=True` (its flash kernel on GPU): the attention costs the sum of each length squared, as
with FlashAttention's varlen kernel, and no mask is built.  Padded batches (evaluation with
`FT_PADDING_FREE=off`) are handled per row the same way.
"""

from __future__ import annotations

from typing import Any

NAME = "fulltune_varlen"


def varlen_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
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
        out[row : row + 1, :, a:b] = sdpa(query[row : row + 1, :, a:b], key[row : row + 1, :, a:b], value[row : row + 1, :, a:b], dropout_p=dropout, scale=scaling, is_causal=b - a > 1)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `NAME` an attention implementation transformers can dispatch to; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)  # None, or the 2-D mask of real tokens
    return NAME
