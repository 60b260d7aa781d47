"""The plan's cost model (trainer/model/step_cost.py): its ranking of layouts against step times measured on CPU,
and the counts its constants rest on."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from trainer.core.config import PRECISIONS
from trainer.model import step_cost
from trainer.model.estimate import flops_per_token, parameter_count

QWEN3_4B = ROOT / "bench" / "qwen3-4b-config.json"
CLEARLY = 1.3  # predicted ratios at least this far apart are ranked; the layouts below are chosen so every pair is


def _qwen3_4b():
    import types

    return types.SimpleNamespace(**json.loads(QWEN3_4B.read_text()))


@pytest.mark.slow  # ~20-40 s on two loaded cores
def test_the_cost_models_ranking_of_four_layouts_is_the_measured_one_on_cpu():
    """8 x 1 and 2 x 4 and 1 x 8 without recomputation, 1 x 8 with every layer recomputed: a tiny Qwen3 trained a few
    steps in each, interleaved (bench/step_cost.py), so load from other processes falls on all four alike.  Offload is
    not among them: transformers 5.24 pins its host copies, which a CPU-only torch refuses (docs/memory-plan.md)."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "bench/step_cost.py", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    assert len(results) >= 4
    for a, b in itertools.combinations(results, 2):
        ratio = max(a["estimated_s"], b["estimated_s"]) / min(a["estimated_s"], b["estimated_s"])
        assert ratio >= CLEARLY, (a, b)  # the layouts differ clearly in the model's eyes
        assert (a["estimated_s"] < b["estimated_s"]) == (a["measured_s"] < b["measured_s"]), results


@pytest.mark.slow  # imports torch and transformers: 5 s alone, half a minute on loaded cores
def test_a_qwen3_layers_operations_are_what_the_cost_model_counts():
    """A layer's backward issues about twice its forward's operations, and a recomputed layer's backward its forward's
    again (FORWARD, BACKWARD, RECOMPUTE: the CPU timing of the checkpoint's own Python puts RECOMPUTE above the count)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Qwen3Config, Qwen3ForCausalLM

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def counts(layers: int, every: int) -> tuple[int, int]:
        torch.manual_seed(0)
        net = Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, use_cache=False))
        if every:
            net.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)
        ids = torch.randint(0, 300, (1, 32))
        with Count() as forward:
            loss = net(input_ids=ids, labels=ids).loss
        with Count() as backward:
            loss.backward()
        return forward.n, backward.n

    (f2, b2), (f4, b4), (_, r4) = counts(2, 0), counts(4, 0), counts(4, 1)
    forward, backward, recomputed = (f4 - f2) / 2, (b4 - b2) / 2, (r4 - b4) / 4
    assert 80 <= forward <= 100, forward  # 91 with transformers 5.24
    assert backward / forward == pytest.approx(step_cost.BACKWARD / step_cost.FORWARD, rel=0.15)
    assert 1.0 <= recomputed / forward <= step_cost.RECOMPUTE


def test_recomputing_every_layer_of_qwen3_4b_costs_its_forward_again():
    """27.8 GFLOP a token without recomputation at 2048 tokens, 36.2 with every layer recomputed (performance anchors:
    the forward is a third of a layer's training FLOPs), so full recomputation is ~30 % more compute."""
    config, fp32 = _qwen3_4b(), PRECISIONS["bf16-mixed"]
    n = parameter_count(config)
    assert flops_per_token(config, n, 2048) == pytest.approx(27.76e9, rel=0.005)

    def compute(every: int) -> float:
        return step_cost.step_cost(config, n, fp32, sequences_per_pass=8, passes_per_step=1, checkpoint_every=every, tokens_per_sequence=2048,
                                   device=step_cost.DEVICES["h100"]).compute

    assert compute(1) / compute(0) == pytest.approx(36.2 / 27.76, rel=0.01)
    assert compute(0) < compute(2) < compute(1)


def test_a_pass_of_few_tokens_runs_below_the_peak_and_offload_costs_its_copies():
    config, mixed, h100 = _qwen3_4b(), PRECISIONS["bf16-mixed"], step_cost.DEVICES["h100"]
    n = parameter_count(config)

    def cost(per_pass: int, tokens: float, every: int = 0, offload: bool = False) -> step_cost.Cost:
        return step_cost.step_cost(config, n, mixed, sequences_per_pass=per_pass, passes_per_step=8 // per_pass, checkpoint_every=every,
                                   tokens_per_sequence=tokens, device=h100, offload=offload)

    assert cost(1, 4096).compute == pytest.approx(cost(8, 4096).compute)  # the same FLOPs in 8 passes or 1
    assert cost(1, 128).seconds / cost(8, 128).seconds > 3 > cost(1, 4096).seconds / cost(8, 4096).seconds  # short passes: the fixed cost rules
    copies = cost(8, 4096, 1, True).offload
    assert copies == pytest.approx(2 * 36 * 8 * 4096 * 4 * 2560 / h100.host_link) and cost(8, 4096, 1).offload == 0


def test_the_mean_sequence_comes_from_the_data_prepared_on_the_volume_at_this_length(tmp_path):
    from trainer.core import settings as settings_table

    settings = settings_table.load({"FT_OUTPUT_DIR": str(tmp_path), "FT_MAX_LENGTH": "2048"})
    assert step_cost.mean_tokens(settings) == (2048.0, "FT_MAX_LENGTH: no data prepared on the volume yet")
    entry = tmp_path / ".fulltune" / "data-cache" / "0123abcd"
    entry.mkdir(parents=True)
    report = {"max_length": 2048, "train_tokens": 11_000, "rows": {"train": 9, "eval": 1}, "eval_source": "FT_EVAL_FRACTION=0.1 of rows.jsonl, seed 42"}
    (entry / "report.json").write_text(json.dumps(report))
    mean, source = step_cost.mean_tokens(settings)
    assert mean == 1100 and "data prepared on the volume" in source  # the held-out rows were counted in the tokens too
    assert step_cost.mean_tokens(settings_table.load({"FT_OUTPUT_DIR": str(tmp_path), "FT_MAX_LENGTH": "4096"}))[0] == 4096  # prepared for another length


def test_the_job_ranks_the_layouts_again_for_the_prepared_datas_mean_sequence(tmp_path, capsys):
    """Preflight: every sequence at FT_MAX_LENGTH=4096 (2 x 4 on an H200's memory); once the data is prepared, its
    ~1.1k-token mean makes shorter passes' fixed cost weigh more: 4 x 2, the memory still planned for 4096 tokens."""
    import shutil

    from trainer.core import settings as settings_table
    from trainer.core.config import Config
    from trainer.model import loading, memory

    shutil.copy(QWEN3_4B, tmp_path / "config.json")
    settings = settings_table.load({"FT_MODEL": str(tmp_path), "FT_OUTPUT_DIR": str(tmp_path / "out"), "FT_GPU_MEMORY_GB": "150.8"})
    job = Config(settings, cuda=False, precision=PRECISIONS["bf16-mixed"])
    config = loading.read_config(settings)
    capacity = memory.device_capacity(settings, cuda=False)
    planned = memory.plan(config, loading.parameter_count(config), settings, job.precision, capacity, "auto", 1, memory.cost_device(capacity, cuda=False))
    assert (planned.sequences_per_pass, planned.checkpoint_every, planned.device.name, planned.device.host_link) == (2, 36, "h200", 0.0)  # no offload on CPU
    again = memory.for_data(job, planned, 1100.0)
    assert (again.sequences_per_pass, again.passes_per_step, again.checkpoint_every, again.fits) == (4, 2, 2, True)
    assert again.seconds < planned.seconds and again.tokens_per_sequence == 1100
    assert "memory plan for the prepared data (a sequence is 1100 tokens on average, not FT_MAX_LENGTH=4096): 4 sequences x 2 passes" in capsys.readouterr().out
    assert memory.for_data(job, planned, None) is planned  # no report: the preflight's plan
