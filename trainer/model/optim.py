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

The random bits come from a torch.Generator seeded with FT_SEED whose state is part of `state_dict()`,
so a job resumed from a checkpoint computes the same weights as one that never stopped.

The step is one parameter at a time: besides the states it holds ~16 B x the largest parameter
(fp32 weight, gradient, denominator, random bits), 6 GB for Qwen3-4B's embedding, after the
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
        self._generator: torch.Generator | None = None
        self._pending_state: torch.Tensor | None = None  # loaded before the first step created the generator

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
            if self._pending_state is not None:
                self._generator.set_state(self._pending_state)
                self._pending_state = None
        return self._generator

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._generator is not None:
            state["rounding_generator"] = self._generator.get_state()
        elif self._pending_state is not None:
            state["rounding_generator"] = self._pending_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("rounding_generator", None)
        super().load_state_dict(state_dict)
        # torch casts floating-point states to the parameter's dtype (bf16) on load: put the fp32 ones back
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step":
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
        if generator_state is not None:
            if self._generator is None:
                self._pending_state = generator_state.cpu()
            else:
                self._generator.set_state(generator_state.cpu())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()  # a CPU tensor (also after load_state_dict): no GPU sync
                grad = p.grad.float()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
                del grad
                value = p.float()  # a copy when p is bf16; p itself when fp32
                value.mul_(1 - lr * decay).addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
                if p.dtype == torch.bfloat16:
                    stochastic_round_(p, value, self.generator(p.device))
                elif p.dtype != torch.float32:
                    p.copy_(value)
        return loss
