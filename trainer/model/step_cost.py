"""The estimated time of one optimizer step for a layout: what the memory plan ranks its layouts by, fastest first.

    step = passes x (compute of the pass + the pass's fixed cost) + offload copies + the optimizer's update

- compute: the FLOPs the pass executes over the device's sustained rate: model FLOPs per token (estimate.py's
  `flops_per_token`, the count of the progress line's MFU) plus, per recomputed layer, its forward once more
  (2 x its parameters + 4 x attention width x sequence length per token: a third of its training FLOPs);
- the pass's fixed cost, what it costs whatever its tokens (why a pass of few tokens runs below the peak): the
  weights it streams through memory (PASS_BYTES per parameter) over the memory's bandwidth, and the operations it
  issues, per decoder layer run (forward 1, backward 2, a recomputation 3: its forward again and the checkpoint's
  own machinery), times the device's cost of issuing one layer's forward;
- offload (transformers' `offload`): each recomputed layer's saved input to host memory in the forward and back in
  the backward, over the host link, on the compute stream (transformers 5.24: not overlapped);
- the optimizer's update: AdamW reads and writes weights, gradients and both states once (OPTIMIZER_BYTES per
  parameter), bound by memory bandwidth, plus the device's fixed cost of a step (on CPU the loop over the tensors).

Tokens per pass are sequences x the mean tokens of a sequence after preparation (padding-free passes hold real
tokens only) when known, else FT_MAX_LENGTH.  Each device's constants and their sources are in DEVICES;
docs/memory-plan.md explains them and tests/test_step_cost.py holds the CPU ranking to measured step times.
Torch-free: `entrypoint.py plan` ranks layouts without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from trainer.core.config import Precision
from trainer.model.estimate import checkpointed_layers, flops_per_token, shape

# Bytes per parameter one pass moves through device memory whatever its tokens (docs/memory-plan.md): bf16-mixed:
# autocast reads the fp32 weight and writes its bf16 copy (4 + 2), the forward's and the backward's matmuls read
# that copy (2 + 2), the weight gradient is written in bf16, upcast and accumulated into the fp32 .grad (2 + 2 + 4 + 4).
PASS_BYTES = {"bf16-mixed": 22, "bf16-sr": 12, "fp32": 16}
# AdamW's update per parameter: weight read + written, gradient read (twice with the norm clipping), both states read +
# written: fp32 4+4 + 4x2 + 16 = 32 B; bf16-sr 2+2 + 2x2 + 16 (+ the fp32 upcasts it computes in) = 24 B.
OPTIMIZER_BYTES = {"bf16-mixed": 32, "bf16-sr": 24, "fp32": 32}
# Decoder-layer runs of one pass, in units of one layer's forward.  Counted with a TorchDispatchMode on a Qwen3 layer
# (tests/test_step_cost.py): forward 91 aten operations, backward 178 (2x); a recomputed layer's backward 320, 1.6x
# more, but timed on CPU (bench/step_cost.py, fitted) its recomputation costs 2.7-3.1 forwards' worth: the
# non-reentrant checkpoint's Python (saved-tensor hooks, the recomputed graph) on top of the operations.
FORWARD, BACKWARD, RECOMPUTE = 1.0, 2.0, 3.0


@dataclasses.dataclass(frozen=True)
class Device:
    """Sustained rates, not datasheet peaks (docs/memory-plan.md#the-cost-model gives each source)."""

    name: str
    flops: float  # FLOP/s of the step's matmuls in passes of many tokens (the dense peak x the efficiency reached)
    memory_bandwidth: float  # bytes/s of the device's memory
    host_link: float  # bytes/s each way between the device and pinned host memory: offload's copies (0: not on this device)
    layer_call_s: float  # seconds to issue one decoder layer's forward (its ~91 operations) that compute does not hide
    step_call_s: float = 0.0  # fixed seconds of an optimizer step besides its bytes (CPU: AdamW's loop over the tensors)


H100_PEAK, EFFICIENCY = 989e12, 0.5  # dense bf16 (NVIDIA's datasheet); published single-GPU full fine-tuning reaches 41-57 % of it
ISSUE = 91 * 4e-6  # 91 operations a layer forward at ~4 us each: PyTorch's dispatch and a CUDA launch (docs/memory-plan.md)
DEVICES = {
    "h100": Device("h100", H100_PEAK * EFFICIENCY, 0.8 * 3.35e12, 0.8 * 64e9, ISSUE),  # HBM3 3.35 TB/s, PCIe Gen5 x16 64 GB/s, at 80 %
    "h200": Device("h200", H100_PEAK * EFFICIENCY, 0.8 * 4.8e12, 0.8 * 64e9, ISSUE),  # the H100's compute, HBM3e 4.8 TB/s
    "a100": Device("a100", 312e12 * EFFICIENCY, 0.8 * 2.04e12, 0.8 * 32e9, ISSUE),  # A100 80 GB SXM: 312 TFLOP/s, 2.04 TB/s, PCIe Gen4
    "l40s": Device("l40s", 362e12 * EFFICIENCY, 0.8 * 0.864e12, 0.8 * 32e9, ISSUE),
    # Fitted to bench/step_cost.py's tiny Qwen3 on a 2-core x86 machine under load (load average ~9, one thread a process:
    # docs/memory-plan.md): load slows all four alike, so their ratios, which rank the layouts, hold.  No offload on CPU:
    # transformers 5.24 pins the host copies, which needs an accelerator (pin_memory raises on a CPU-only torch).
    "cpu": Device("cpu", 17e9, 5e9, 0.0, 1.8e-3, 25e-3),
}


def device_for(name: str, capacity: float) -> Device:
    """The constants for a card by its name (`--card`, or torch's device name), else by its memory: none is a CPU."""
    lowered = name.lower()
    for key in ("h200", "h100", "a100", "l40s"):
        if key in lowered:
            return DEVICES[key]
    if not capacity:
        return DEVICES["cpu"]
    return DEVICES["h200"] if capacity > 100e9 else DEVICES["h100"]


@dataclasses.dataclass(frozen=True)
class Cost:
    """Seconds of one optimizer step, by part."""

    compute: float
    passes: float  # the passes' fixed costs: weights through memory and operations issued
    offload: float
    optimizer: float

    @property
    def seconds(self) -> float:
        return self.compute + self.passes + self.offload + self.optimizer


def step_cost(config: Any, n_params: int, precision: Precision, *, sequences_per_pass: int, passes_per_step: int, checkpoint_every: int,
              tokens_per_sequence: float, device: Device, offload: bool = False, shards: int = 1) -> Cost:
    """The estimated seconds of one optimizer step of this layout on `device` (`shards`: FSDP's, dividing the
    weights each process streams and updates; the collectives are not modelled: every layout has the same)."""
    s = shape(config)
    layers = s["layers"]
    recomputed = checkpointed_layers(checkpoint_every, layers)
    layer_params = (n_params - s["vocab"] * s["hidden"] * (2 - s["tied"]) - s["hidden"]) / layers
    tokens = sequences_per_pass * tokens_per_sequence
    per_token = flops_per_token(config, n_params, tokens_per_sequence) + recomputed * (2 * layer_params + 4 * s["q"] * tokens_per_sequence)
    compute = tokens * per_token / device.flops
    streamed = PASS_BYTES[precision.name] * n_params / shards / device.memory_bandwidth
    issued = (layers * (FORWARD + BACKWARD) + recomputed * RECOMPUTE) * device.layer_call_s
    moved = 2 * recomputed * tokens * precision.weight_bytes * s["hidden"] / device.host_link if offload and device.host_link else 0.0
    update = OPTIMIZER_BYTES[precision.name] * n_params / shards / device.memory_bandwidth + device.step_call_s
    return Cost(passes_per_step * compute, passes_per_step * (streamed + issued), passes_per_step * moved, update)


def mean_tokens_of(report: dict[str, Any]) -> float | None:
    """Tokens of the mean training sequence in a data report (trainer/data/data_report.py), after preparation: its token
    count covers the rows FT_EVAL_FRACTION later held out of them too."""
    try:
        rows = report["rows"]["train"] + (report["rows"]["eval"] if str(report.get("eval_source", "")).startswith("FT_EVAL_FRACTION") else 0)
        return report["train_tokens"] / rows if rows else None
    except (KeyError, TypeError):
        return None


def mean_tokens(settings: Any) -> tuple[float, str]:
    """Tokens of the mean sequence after preparation, and where that came from: the report of the newest data cache
    entry on the volume prepared at this FT_MAX_LENGTH (an earlier run of the job), else FT_MAX_LENGTH: every sequence
    as long as allowed, what the memory plan assumes too.  `plan` tokenizes nothing: that needs the model's tokenizer,
    which transformers loads with torch, and the job ranks the layouts again once it has prepared the data."""
    from trainer.core.volume import Volume

    cache = Volume(settings.output_dir).data_cache
    reports = sorted(((os.path.getmtime(path), path) for entry in (os.listdir(cache) if os.path.isdir(cache) else [])
                      if os.path.isfile(path := os.path.join(cache, entry, "report.json"))), reverse=True)
    for _, path in reports:
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and report.get("max_length") == settings.max_length and (mean := mean_tokens_of(report)):
            return mean, f"the data prepared on the volume ({path})"
    return float(settings.max_length), "FT_MAX_LENGTH: no data prepared on the volume yet"
