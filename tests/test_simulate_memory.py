"""bench/simulate_memory.py: torch's own accounting of one optimizer step, on fake tensors, is what real tensors give."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import recompute_retention  # noqa: E402
import simulate_memory  # noqa: E402


def _small(layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, tie_word_embeddings=True)


@pytest.mark.parametrize("recompute", [0, 1])
def test_fake_tensors_account_the_same_bytes_as_real_ones_in_every_phase(recompute):
    """The simulator's premise: a step on fake tensors allocates exactly what the same step on real tensors does."""
    fake = simulate_memory.simulate(_small(2), sequences=2, length=128, recompute=recompute, fake=True)
    real = simulate_memory.simulate(_small(2), sequences=2, length=128, recompute=recompute, fake=False)
    assert fake["phases"] == real["phases"]
    assert fake["peak"] == real["peak"]
    assert fake["flops_per_token"] == real["flops_per_token"]
    assert set(fake["phases"]) == {"forward 1", "backward 1 loss", "backward 1 layers", "optimizer"}


def test_recomputation_lowers_the_forward_peak_and_adds_a_forward_to_the_backward_flops():
    kept = simulate_memory.simulate(_small(2), sequences=2, length=128, recompute=0)
    recomputed = simulate_memory.simulate(_small(2), sequences=2, length=128, recompute=1)
    assert recomputed["phases"]["forward 1"]["Total"] < kept["phases"]["forward 1"]["Total"]
    assert recomputed["flops_per_token"]["backward"] > kept["flops_per_token"]["backward"]
    assert recomputed["flops_per_token"]["forward"] == kept["flops_per_token"]["forward"]


@pytest.mark.slow  # seven passes of a 2- and 4-layer model on real tensors, ~2 s each on a quiet machine
def test_recomputed_layers_free_their_tensors_in_the_backward_and_the_simulator_reports_what_is_alive():
    """A recomputed layer's tensors die with its backward: at the embedding's backward the step holds what it holds
    without recomputation, with or without MemTracker.  Only FlopCounterMode's module tracking around the backward
    keeps them (more with each layer), which is why the simulator counts FLOPs without it."""
    def at_embedding(layers, recompute, observer="none"):
        return recompute_retention.measure(_small(layers), recompute=recompute, observer=observer, sequences=2, length=128, fake=False)

    held = {}
    for layers in (2, 4):
        kept, freed = at_embedding(layers, 0), at_embedding(layers, 1)
        assert freed["at"]["embedding"] == kept["at"]["embedding"]  # nothing of the recomputed layers is left
        assert freed["layers peak"] <= kept["layers peak"]
        held[layers] = at_embedding(layers, 1, "flopcounter")["at"]["embedding"] - freed["at"]["embedding"]
    assert 0 < held[2] < held[4]  # the observer's retention grows with the recomputed layers
    watched = at_embedding(4, 1, "memtracker")
    assert watched["at"]["embedding"] == freed["at"]["embedding"]  # MemTracker changes nothing alive ...
    assert watched["memtracker peak"] == pytest.approx(watched["peak"], rel=1e-3)  # ... and counts what is
    simulated = simulate_memory.simulate(_small(4), sequences=2, length=128, recompute=1, fake=False)
    # the simulator reports what is alive, in the layers' backward too, where the recomputed tensors were counted
    assert simulated["phases"]["backward 1 layers"]["Total"] / 1e9 == pytest.approx(freed["layers peak"], rel=0.005)
    assert simulated["peak"] / 1e9 == pytest.approx(freed["peak"], rel=0.005)
