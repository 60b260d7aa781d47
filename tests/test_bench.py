"""The benchmark measures the job users run, and compares variants only from interleaved runs."""

from __future__ import annotations

import os

import pytest

from bench import child, synthetic
from bench import run as bench_run


def test_bench_fulltune_variant_trains_the_jobs_own_trainer(tmp_path, monkeypatch):
    import trl

    from trainer import job
    from trainer.checkpointing import commits as checkpoints
    from trainer.model import attention, memory, recipe, sharding
    from trainer.tracking import metrics, progress

    synthetic.build(str(tmp_path), rows=40, mean_tokens=48, gpu=False, config_path="", vocab=300)
    args = bench_run.parse(["--steps", "2", "--eval-steps", "1", "--no-mlflow", "--work", str(tmp_path)])
    built = []

    def build_trainer(*a, **kw):
        built.append(original(*a, **kw))
        return built[-1]

    original = job.build_trainer
    monkeypatch.setattr(job, "build_trainer", build_trainer)
    config = child.fulltune_config(args, str(tmp_path), "fulltune", {}, cuda=False)
    plan = memory.preflight(config)
    expected = recipe.sft_config(config.settings, config.precision, plan, cuda=False).to_dict()  # before the Trainer: it resets accelerate's state
    timer = child._timer(0.0)
    trainer = child.fulltune(config, timer)

    assert built == [trainer], "bench/child.py must build the fulltune variant with trainer.job.build_trainer"
    assert isinstance(trainer, trl.SFTTrainer) and type(trainer) is sharding.trainer_class(config.cuda, plan.strategy)  # the job's class
    callbacks = trainer.callback_handler.callbacks
    for kind in (checkpoints.CommitCheckpoints, progress.Progress, metrics.MetricsCallback):
        assert any(isinstance(c, kind) for c in callbacks), kind
    assert timer in callbacks
    assert trainer.args.to_dict() == expected
    assert trainer.data_collator.padding_free and trainer.model.config._attn_implementation == attention.register()

    trainer.train()
    assert trainer.state.global_step == 2 and timer.train_s > 0


def _run(round_: int, wall: float) -> dict:
    return {"round": round_, "wall_s": wall, "tokens_per_s": 1000 / wall, "losses": [2.0, 1.9], "layout": "8x1", "load_avg": [1.0, 1.0], "overrides": {}}


def test_ratio_only_from_interleaved_rounds_and_min_median_per_variant():
    args = bench_run.parse(["--rounds", "2", "--steps", "2"])
    one_round = {"literal": [_run(1, 100.0)], "fulltune": [_run(1, 50.0)]}
    text = bench_run.table(args, [], {}, one_round, [])
    assert "fulltune / literal" not in text and "No ratio" in text

    two_rounds = {"literal": [_run(1, 100.0), _run(2, 120.0)], "fulltune": [_run(1, 50.0), _run(2, 70.0)]}
    text = bench_run.table(args, [], {}, two_rounds, [])
    wall = next(line for line in text.splitlines() if line.startswith("| end-to-end wall"))
    assert wall == "| end-to-end wall (s) | 100.0 / 110.0 | 50.0 / 60.0 | 0.50 · 0.55 · 0.50, 0.58 |"
    speed = next(line for line in text.splitlines() if line.startswith("| training tokens/s"))
    assert "| 10 / 9 | 20 / 17 |" in speed  # rates: max / median


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_variant_on_cpu_and_the_stepdown_one_steps_down_out_of_memory(tmp_path):
    """`bash bench/gpu_check.sh --dry-run` (CI): the wheel list matches what is installed, the Qwen3-4B plans print, and
    every variant that can run on CPU trains, the stepdown one after an (injected) out-of-memory error."""
    import subprocess
    import sys

    from conftest import ROOT

    env = ({k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_", "FAULT_"))}
           | {"PYTHON": sys.executable, "BENCH_WORK": str(tmp_path / "work")})
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "gpu_check: wheel list: 9 pins, each the version installed here" in log
    assert log.count("B parameters; chosen") == 4  # defaults, 4096 tokens, as-set, bf16-sr
    table = {line.split(" | ")[0].lstrip("| "): line.strip(" |").split(" | ")[1:] for line in log.splitlines() if line.startswith("| ")}
    assert "| | literal (one run) | fulltune (one run) | loop (one run) | padded (one run) | stepdown (one run) |" in log
    # 8 x 1 recomputing none, 1, 2, then all 4 layers (each choice the plan lists), then 4 x 2: it fits
    assert table["out-of-memory step-downs before it trained"][1:] == ["0", "0", "0", "4"]
    assert float(table["peak memory planned (GB, the plan that trained)"][4]) > 0
    assert table["attention (and its self-check)"][1:] == [
        "per-sequence SDPA loop (no CUDA: no self-check)", "per-sequence SDPA loop (chosen by the benchmark)", "sdpa",
        "per-sequence SDPA loop (no CUDA: no self-check)",
    ]
    assert table["layout (seqs x passes), recomputation, padding-free"][4].startswith("4x2")
