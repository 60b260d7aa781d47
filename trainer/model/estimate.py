"""The estimate: bytes by component at the peak of each phase of one optimizer step, from a model's sizes alone.

Modelled phase by phase as torch's own accounting shows the step (bench/simulate_memory.py: MemTracker on fake
tensors), not every term at once; docs/memory-plan.md explains each term and lists the CUDA-only ones.
"""

from __future__ import annotations

from typing import Any

from trainer.core.config import Precision

SIMULATED_TOLERANCE = 0.05  # the plan's peak against torch's own accounting of the same step (tests/test_plan_vs_simulation.py)
LOSS_TILE_TOKENS, LOSS_TILE_VOCAB = 4096, 32768  # trl.kernels.chunked_logprob tile
# Fitted to bench/simulate_memory.py on Qwen3-4B's sizes with 2 and 4 layers (docs/memory-plan.md):
FORWARD_TILE_BYTES = 15  # per tile element: the bf16 product and the torch fold's fp32 temporaries (Triton on CUDA: 2)
BACKWARD_TILE_BYTES = 30  # the recomputed tile, its fp32 gradient and the fp32 upcasts of the torch path
STREAM_COPIES = {4: 14, 2: 8}  # per token, x hidden bytes: embeddings, final norm, the LM head's input, by weight bytes
TIED_GRADIENT_COPIES = 3  # the LM head's and the embedding's gradients of a tied weight, and their sum, at once
# No term for the recomputed layers at the backward's end: each layer's recomputed tensors are freed by its own
# backward.  The simulator once counted them until the backward ended (+13 GB for Qwen3-4B at 1 x 2048, and 2.76 B
# per layer parameter for an FSDP rank): its FlopCounterMode held them, not the step (bench/recompute_retention.py).
CUDA_CONTEXT, CUBLAS_WORKSPACE, ALLOCATOR_SLACK = 2**30 - 2**27, 2**27, 0.05  # 1 GiB + 5 %, unchanged until a GPU measures them
# NCCL's own device buffers, per communicator, outside the caching allocator (invisible to max_memory_allocated): its
# channels' send/receive buffers (NCCL_BUFFSIZE, 4 MiB a protocol buffer, per peer and channel, up to 32 channels on
# an NVLink H100) and, on NVSwitch machines, NVLS's multicast buffers.  An assumption of hundreds of MB to ~1 GiB
# (NCCL's environment documentation); the first multi-GPU run measures it
# (docs/gpus.md#read-against-the-libraries-before-the-first-gpu-run-model-precision-sharding-memory).
NCCL_BUFFERS = 2**30


def checkpointed_layers(every: int, layers: int) -> int:
    """Layers 0, n, 2n, ... recompute (transformers' `every_n_layers`); 0 = none."""
    return -(-layers // every) if every else 0


def checkpointing_label(every: int, layers: int) -> str:
    if not every:
        return "off"
    if every == 1:
        return "full (every layer)"
    return f"selective (every {every} layers: {checkpointed_layers(every, layers)} of {layers})"


def shape(config: Any) -> dict[str, int]:
    """The sizes the estimate needs, from a transformers config of a decoder-only model (or its config.json's fields).

    This module owns `head_dim` and the FLOPs per token (`flops_per_token`), which console/progress.py and step_cost.py use."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return {
        "layers": text.num_hidden_layers,
        "hidden": hidden,
        "heads": heads,
        "head_dim": head_dim,
        "q": heads * head_dim,
        "kv": (getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        "intermediate": getattr(text, "intermediate_size", None) or 4 * hidden,
        "vocab": text.vocab_size,
        "tied": int(bool(getattr(text, "tie_word_embeddings", False))),
    }


def parameter_count(config: Any) -> int:
    """Parameters of a Llama/Qwen-style decoder from its sizes alone, without torch (`entrypoint.py plan`);
    tests/test_plan_vs_simulation.py holds it equal to transformers' model for Qwen3."""
    s = shape(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, q, kv = s["hidden"], s["q"], s["kv"]
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if getattr(text, "attention_bias", False) else 0)
    qk_norms = 2 * s["head_dim"] if getattr(text, "model_type", "qwen3") == "qwen3" else 0
    layer = attention + 3 * h * s["intermediate"] + 2 * h + qk_norms
    return s["vocab"] * h * (2 - s["tied"]) + s["layers"] * layer + h


def flops_per_token(config: Any, n_params: int, mean_sequence: float) -> float:
    """Model FLOPs of a training step per token: 6N for the matmuls (the tied embedding counts once, as the LM head) +
    12 L H d S for attention (the full square of scores, as PaLM and torchtitan count it).  No recomputation: a
    recomputed layer's forward is trainer/model/step_cost.py's to add."""
    s = shape(config)
    matmul_params = n_params if s["tied"] else n_params - s["vocab"] * s["hidden"]
    return 6 * matmul_params + 12 * s["layers"] * s["q"] * mean_sequence


def offloaded_bytes(config: Any, precision: Precision, sequences_per_pass: int, max_length: int, checkpoint_every: int) -> float:
    """Host memory the offloaded inputs of a pass's recomputed layers take at once (transformers' `offload`: pinned)."""
    s = shape(config)
    return float(checkpointed_layers(checkpoint_every, s["layers"]) * sequences_per_pass * max_length * precision.weight_bytes * s["hidden"])


def layer_bytes_per_token(s: dict[str, int], act: int, stream: int = 4) -> float:
    """Tensors one decoder layer saves for its backward, per token (`act`: bytes of a matmul output).

    bf16-mixed, Qwen3-4B: 216.4 KB, as bench/simulate_memory.py counts it (tests/test_memory.py)."""
    h, q, kv, inter = s["hidden"], s["q"], s["kv"], s["intermediate"]
    norms = 4 * 4 * h if stream == 4 else 6 * h  # two RMSNorms: fp32 input and output each; a bf16 stream (bf16-sr) saves 10h less (simulated)
    attention = act * (q + 2 * kv) + 4 * 2 * (q + kv) + act * 2 * (q + kv) + act * 2 * q  # qkv, q/k norms, rope, out
    attention += act * (q + kv) + 4 * s["heads"] * 2  # q/k norms' casts, which their weights multiply; the kernel's fp32 log-sum-exp
    mlp = act * 4 * inter  # gate, up, activation, product
    return norms + attention + mlp


def estimate(config: Any, n_params: int, **layout: Any) -> dict[str, float]:
    """Peak bytes of one process by component, at the step's highest phase (`layout`: the arguments of `phases`)."""
    each = phases(config, n_params, **layout)
    return each[max(each, key=lambda name: sum(each[name].values()))]


def phases(
    config: Any, n_params: int, *, precision: Precision, sequences_per_pass: int, passes_per_step: int, max_length: int, checkpoint_every: int, shards: int = 1,
    processes: int = 1, communicators: int = 1, offload: bool = False,
) -> dict[str, dict[str, float]]:
    """Bytes by component at the peak of each phase of the step (docs/memory-plan.md; bench/simulate_memory.py measures
    the same phases): the forward (the last pass: earlier passes' gradients are alive), the start of the backward (the
    loss's gradient), its end (every gradient, the tied embedding's twice), and the optimizer's update.  `processes`: of
    the job (more than one: NCCL's buffers on a GPU, `communicators` of them).  `offload`: the recomputed layers' saved
    inputs are held in host memory (transformers' `offload`), so they leave the device's activations."""
    s = shape(config)
    layers, h, vocab = s["layers"], s["hidden"], s["vocab"]
    embedding = vocab * h
    layer_params = (n_params - embedding * (2 - s["tied"]) - h) / layers
    tokens = sequences_per_pass * max_length
    tile = min(tokens, LOSS_TILE_TOKENS) * min(vocab, LOSS_TILE_VOCAB)
    act = 2 if precision.bf16 else 4
    stream = precision.weight_bytes  # the residual stream's dtype: a recomputed layer's saved input
    recomputed = checkpointed_layers(checkpoint_every, layers)
    copies = 2 * layer_params * layers if precision.autocast_copies else 0.0  # autocast caches each cast until the forward ends
    kept_inputs = 0 if offload else recomputed * stream * h  # offloaded: one layer's input comes back at a time, for its recompute
    saved = tokens * ((layers - recomputed) * layer_bytes_per_token(s, act, stream) + kept_inputs + STREAM_COPIES[stream] * h)
    static = {
        "weights": float(precision.weight_bytes * n_params) / shards,
        "optimizer": float(precision.optimizer_bytes * n_params) / shards,
    }
    gradients = float(precision.gradient_bytes * n_params) / shards
    root = n_params - layer_params * layers  # embeddings, LM head and final norm: FSDP's root unit
    gather = {}  # FSDP2 (one rank of `shards`): the root unit stays whole from its first forward to its backward's end
    if shards > 1:
        gather = {"root, gathered": precision.weight_bytes * root,
                  "layers, gathered": 2 * precision.weight_bytes * layer_params}  # this layer and the prefetched one
    earlier = {"gradients": gradients} if passes_per_step > 1 else {}
    forward = static | gather | earlier | {"bf16 copies": copies, "activations": saved, "loss": FORWARD_TILE_BYTES * tile}
    backward_start = static | gather | earlier | {
        "layers, gathered": gather.get("layers, gathered", 0) / 2,
        "bf16 copies": copies * (layers - recomputed) / layers,  # the cache is gone; kept layers saved theirs
        "activations": saved,
        "loss": BACKWARD_TILE_BYTES * tile + 4 * min(vocab, LOSS_TILE_VOCAB) * h + 4 * tokens * h + 4 * embedding,
    }
    if shards > 1:
        backward_end = static | {
            "root, gathered": gather["root, gathered"],
            "gradients": gradients if passes_per_step > 1 else precision.gradient_bytes * layer_params * layers / shards,
            "root gradients": precision.gradient_bytes * root * (TIED_GRADIENT_COPIES if s["tied"] else 1),
            "layer gradient, reduce-scatter": precision.gradient_bytes * layer_params,
        }
    else:
        backward_end = static | {
            "gradients": gradients if passes_per_step > 1 else precision.gradient_bytes * (n_params - embedding),
            "tied gradient": TIED_GRADIENT_COPIES * precision.gradient_bytes * embedding if s["tied"] else precision.gradient_bytes * embedding,
            "activations": STREAM_COPIES[stream] * h * tokens if recomputed else 0.0,  # the embeddings' output and the final norm's
        }
    largest = max(embedding, layer_params) / shards  # the per-parameter loop's fp32 temporaries (trainer/model/optim.py): of its shard under FSDP
    update = static | {"gradients": gradients, "update": (12 * largest if precision.stochastic_rounding else 0.0)}
    each = {"forward": forward, "backward start": backward_start, "backward end": backward_end, "optimizer": update}
    if precision.bf16:  # only on GPU: CUDA context, cuBLAS workspace and allocator slack (docs/memory-plan.md)
        for parts in each.values():
            parts["workspace"] = cuda_only(sum(parts.values())) + (NCCL_BUFFERS * communicators if processes > 1 else 0)
    return {name: {k: float(v) for k, v in parts.items() if v} for name, parts in each.items()}


def cuda_only(simulated: float) -> float:
    """What no CPU simulation holds (docs/memory-plan.md gives the sources): the CUDA context (outside the caching
    allocator, inside the card's total), cuBLAS/cuBLASLt workspaces (per handle and stream) and the caching
    allocator's fragmentation (reserved but not allocated)."""
    return CUDA_CONTEXT + CUBLAS_WORKSPACE + ALLOCATOR_SLACK * simulated
