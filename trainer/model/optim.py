"""AdamW for bf16 weights, written back with stochastic rounding (`FT_PRECISION=bf16-sr`).

Why it exists: the seed notebook updated bf16 weights in place with round-to-nearest.  At lr 2e-5
most updates are below half a bf16 ulp (2^-9 of the weight) and round away: in tests/test_precision.py
only ~30 % of the weight elements change in 6 steps.  bf16-mixed fixes that with an fp32 master copy
(16 B/param).  This optimizer keeps the weights and gradients in bf16 and only the AdamW states in
fp32 (12 B/param: 48 GB instead of 64 GB for Qwen3-4B).  Each step is computed in fp32 from fp32
copies of the weight and gradient, then rounded into bf16 *stochastically*: up with probability equal
to the fraction of the ulp, so a small update is kept in expectation instead of always lost.
torchao's `_AdamW(bf16_stochastic_round=True)` does the same, but torchao is not on our image.

The states stay fp32 (8 B/param; bf16 would save 4 more): in bf16, exp_avg_sq's decay per step
(1 - beta2 = 0.1 % of its value) is below half an ulp (0.2 %) and rounds away, so it cannot follow a
gradient that shrinks: 7x too large 2000 steps after the gradients drop 10x (bench/RESULTS.md).

The random bits come from a torch.Generator seeded, for each parameter at each step, from FT_SEED, the step, the
parameter's place in the optimizer and (under FSDP) the shard: the bits are a function of where they are used, so
nothing needs saving for a job resumed from a checkpoint to compute the same weights as one that never stopped,
however the checkpoint was written (DCP, under FSDP, keeps only an optimizer's `state` and `param_groups`).  DDP's
replicas draw the same bits, as they must to stay equal.

Under FSDP2 the parameters, their gradients and the states are DTensors: the update runs on each one's local shard
(`to_local()`), so the random bits have the shard's shape and every tensor of the update is this process's part.

The step is one parameter at a time: besides the states it holds ~16 B x the largest parameter
(fp32 weight, gradient, denominator, random bits; its shard under FSDP), 6 GB for Qwen3-4B's embedding, after the
backward has freed the activations.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """Write fp32 `value` into bf16 `target`: add random bits below bf16's 16-bit mantissa, then truncate."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, device=value.device, generator=generator)
    bits.add_(noise).bitwise_and_(-65536)  # in place: `value` now holds a bf16-representable number
    target.copy_(value)  # exact: the low 16 bits are zero


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction), fp32 states, any weight dtype.

    bf16 weights are written back with stochastic rounding; fp32 weights get the plain AdamW update.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, seed: int = 0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device, step: int, index: int, shard: int) -> torch.Generator:
        """The generator for one parameter's rounding at one step, reseeded: its bits depend on nothing else."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(hash((self.seed, step, index, shard)) & (2**63 - 1))  # an int tuple's hash: the same in every process

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        state_dict.pop("rounding_generator", None)  # what checkpoints of earlier versions saved: the bits no longer need it
        super().load_state_dict(state_dict)
        # torch casts floating-point states to the parameter's dtype (bf16) on load: put the fp32 ones back
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step":
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)  # a DTensor like p under FSDP
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()  # a CPU tensor (also after load_state_dict): no GPU sync
                weight, grad, exp_avg, exp_avg_sq = (local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
                grad = grad.float()
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                del grad
                value = weight.float()  # a copy when the weight is bf16; the weight itself when fp32
                value.mul_(1 - lr * decay).addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
                if weight.dtype == torch.bfloat16:
                    stochastic_round_(weight, value, self.generator(weight.device, int(step), index, shard_index(p)))
                elif weight.dtype != torch.float32:
                    weight.copy_(value)
        return loss


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard (its storage: updated in place), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_index(tensor: torch.Tensor) -> int:
    """Which shard of a DTensor this process holds, over the mesh dimensions it is sharded on (HSDP's replicas share
    one: they must stay equal); 0 for a plain tensor (one process, or DDP's equal replicas)."""
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None:
        return 0
    coordinate, index = mesh.get_coordinate() or [], 0
    for dim, placement in enumerate(tensor.placements):
        if placement.is_shard():
            index = index * mesh.size(dim) + coordinate[dim]
    return index
