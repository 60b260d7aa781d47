"""The benchmark measures the job users run, and compares variants only from interleaved runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import child, synthetic
from bench import run as bench_run


def test_bench_fulltune_variant_trains_the_jobs_own_trainer(tmp_path, monkeypatch):
    import trl

    from trainer import sft_trainer
    from trainer.checkpointing import commits as checkpoints
    from trainer.checkpointing import job_trainer
    from trainer.console import progress
    from trainer.model import attention, memory, recipe
    from trainer.tracking import metrics

    synthetic.build(str(tmp_path), rows=40, mean_tokens=48, gpu=False, config_path="", vocab=300)
    args = bench_run.parse(["--steps", "2", "--eval-steps", "1", "--no-mlflow", "--work", str(tmp_path)])
    built = []

    def build_trainer(*a, **kw):
        built.append(original(*a, **kw))
        return built[-1]

    original = sft_trainer.build_trainer
    monkeypatch.setattr(sft_trainer, "build_trainer", build_trainer)
    config = child.fulltune_config(args, str(tmp_path), "fulltune", {}, cuda=False)
    plan = memory.preflight(config)
    expected = recipe.sft_config(config.settings, config.precision, plan, cuda=False).to_dict()  # before the Trainer: it resets accelerate's state
    timer = child._timer(0.0)
    trainer = child.fulltune(config, timer)

    assert built == [trainer], "bench/child.py must build the fulltune variant with trainer.sft_trainer.build_trainer"
    assert isinstance(trainer, trl.SFTTrainer) and type(trainer) is job_trainer.trainer_class(config.cuda, plan.strategy)  # the job's class
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


def _dry_run(tmp_path, *extra: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    from conftest import ROOT

    env = ({k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_", "FAULT_", "BENCH_")) and k != "OUT"}
           | {"PYTHON": sys.executable, "BENCH_WORK": str(tmp_path / "work")} | env)
    started = time.monotonic()
    command = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", *extra]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    return result, time.monotonic() - started


def _table(text: str) -> dict[str, list[str]]:
    return {line.split(" | ")[0].lstrip("| "): line.strip(" |").split(" | ")[1:] for line in text.splitlines() if line.startswith("| ")}


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_variant_on_cpu_writes_each_as_it_finishes_and_the_stepdown_one_steps_down_out_of_memory(tmp_path):
    """`bash bench/gpu_check.sh --dry-run` (CI): the wheel list matches what is installed, the Qwen3-4B plans print, and
    every variant that can run on CPU trains, the stepdown one after an (injected) out-of-memory error; each variant's
    result and log, and the table so far, are in the results folder ($OUT on the GPU machine) as each finishes."""
    result, took = _dry_run(tmp_path, OUT=str(tmp_path / "out"))
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    print(f"dry run: {took:.0f} s")
    assert "gpu_check: wheel list: 9 pins, each the version installed here, their requirements met" in log
    assert "gpu_check: torch 2.13.0" in log and "varlen_attn is there" in log
    assert "gpu_check: triton: no CUDA device here: skipped" in log
    assert log.count("B parameters; chosen") == 4  # defaults, 4096 tokens, as-set, bf16-sr
    names = ["literal", "fulltune", "stepdown", "save", "loop", "padded"]
    header = "| | " + " | ".join(f"{name} (one run)" for name in names) + " |"
    assert header in log
    out = tmp_path / "out"
    for name in names:  # each as it finished: its result and its whole log
        assert "BENCH-RESULT " in (out / f"{name}-r1.log").read_text()
        assert json.loads((out / f"{name}-r1.json").read_text())["round"] == 1
    written = (out / "RESULTS.md").read_text()  # written by run.py itself, the last time after the last variant
    assert header in written and written.strip() in log
    table = _table(written)
    assert table["run"] == ["finished"] * len(names)
    # 8 x 1 recomputing none, 1, 2, then all 4 layers (each choice the plan lists), then 4 x 2: it fits
    assert table["out-of-memory step-downs before it trained"][1:] == ["0", "4", "0", "0", "0"]
    assert float(table["peak memory planned (GB, the plan that trained)"][2]) > 0
    assert table["attention (and its self-check)"][1:] == [
        "per-sequence SDPA loop (no CUDA: no self-check)", "per-sequence SDPA loop (no CUDA: no self-check)",
        "per-sequence SDPA loop (no CUDA: no self-check)", "per-sequence SDPA loop (chosen by the benchmark)", "sdpa",
    ]
    assert table["layout (seqs x passes), recomputation, padding-free"][2].startswith("4x2")
    # Only the save variant writes checkpoints (transformers saves at the last step whatever save_steps says).
    assert table["checkpoints written"] == ["-", "-", "-", "2", "-", "-"]
    for name in names:
        folder = tmp_path / "work" / f"out-{name}-r1"
        saved = sorted(p.name for p in folder.rglob("checkpoint-*") if p.is_dir())
        assert saved == (["checkpoint-2"] if name == "save" else []), (name, saved)  # FT_SAVE_TOTAL_LIMIT=1
    fulltune = json.loads((out / "fulltune-r1.json").read_text())
    assert 0 < fulltune["timed_tokens"] < fulltune["tokens"]  # the first step is left out of tokens/s (2 steps: the last one is kept)


@pytest.mark.slow
def test_gpu_check_ends_within_its_budget_and_still_writes_the_table_of_what_ran(tmp_path):
    """The GPU check must return within one device call: a variant still training at the budget is stopped, the ones not
    started are named, and the table is written (by run.py, on the SIGTERM of `timeout`)."""
    budget = 100  # the checks before the variants take 20-40 s here: the slow one starts, and is stopped
    # The slow variant as on a slow device: its passes wait (FAULT_SECONDS_PER_PASS) instead of keeping a core busy until the budget.
    result, took = _dry_run(tmp_path, "--only", "slow,padded", "--variant", "slow:FT_MAX_STEPS=100000,FAULT_SECONDS_PER_PASS=1", OUT=str(tmp_path / "out"),
                            BENCH_BUDGET_SECONDS=str(budget))
    log = result.stdout + result.stderr
    print(f"budget {budget} s: ended after {took:.0f} s, exit {result.returncode}")
    assert took <= budget + 5, log[-3000:]
    assert result.returncode != 0, log[-3000:]  # what was stopped is not a success
    written = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "| | slow (one run) | padded (one run) |" in written, written
    assert _table(written)["run"] == ["stopped (time)", "not run (time)"], written
    assert json.loads((tmp_path / "out" / "slow-r1.json").read_text())["stopped"] is True and "round 1 slow stopped: out of time" in log
    # Its log, as far as it got, is kept (empty when the checks before it took most of the budget on a loaded machine).
    assert "BENCH-RESULT" not in (tmp_path / "out" / "slow-r1.log").read_text()


def test_the_first_steps_are_left_out_of_the_timed_tokens():
    """B3: Triton's JIT, cuBLAS's first launches and AdamW's state allocation are in the first steps, not in tokens/s."""
    from transformers import TrainerControl, TrainerState

    class Passes:  # what the timer reads: TRL's running count of training tokens
        _total_train_tokens = 0

    timer, passes, state = child._timer(0.0, warmup=2), Passes(), TrainerState(max_steps=5)
    timer.restart(passes)
    for step, tokens in enumerate([100, 200, 300, 400, 500], start=1):
        timer.on_step_begin(None, state, TrainerControl())
        passes._total_train_tokens += tokens
        state.global_step = step
        timer.on_step_end(None, state, TrainerControl())
    assert timer.steps == 5 and timer.tokens == 300 + 400 + 500 and timer.train_s > 0
    timer.restart(passes)  # a new trainer after an out-of-memory error: its steps only
    assert (timer.steps, timer.tokens, timer.train_s) == (0, 0.0, 0.0)


class StandInCuda:
    """torch.cuda's two calls the cap makes, for an H200 (143,771 MiB), strict as torch is: a fraction outside (0, 1] raises."""

    def __init__(self, total: int):
        self.total, self.fractions = total, []

    def get_device_properties(self, device):
        return type("Properties", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, fraction, device=None):
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fractions.append(fraction)


def test_a_plan_for_a_smaller_card_is_held_to_that_card_and_a_larger_one_is_not_capped(monkeypatch):
    """B2: on an H200 the 80 GB plan meets 80 GB (and the stepdown variant, planned for 140 GB, runs out of memory there)."""
    import torch

    cuda = StandInCuda(143771 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", cuda.get_device_properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cuda.set_per_process_memory_fraction)
    assert child.cap_memory(80) == "the allocator capped at 80 GB of the device's 150.8 GB"
    assert cuda.fractions == [pytest.approx(80e9 / (143771 * 2**20))]
    assert child.cap_memory(240) is None and child.cap_memory(0) is None and len(cuda.fractions) == 1


def test_gpu_check_says_varlen_cannot_be_compared_before_torch_2_13(tmp_path):
    """B6: the lent machine's image had torch 2.11, whose varlen_attn lacks window_size and enable_gqa: the job's attention
    is then the loop in every variant, and the check says so (and leaves the loop variant out) instead of comparing it
    with itself.  The function is gpu_check.sh's own, run against a torch 2.11 distribution's metadata."""
    from conftest import ROOT

    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    function = script[script.index("torch_version() {"): script.index("\n}\n", script.index("torch_version() {")) + 3]
    old = tmp_path / "site" / "torch-2.11.0.dist-info"
    old.mkdir(parents=True)
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
    for path, code in ((str(tmp_path / "site"), 1), ("", 0)):
        env = dict(os.environ, PYTHONPATH=path, python=sys.executable)
        done = subprocess.run(["bash", "-c", f'{function}\npython="$python"; torch_version'], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == code, done.stdout + done.stderr
        assert ("varlen against loop cannot be compared" in done.stdout) == (code == 1), done.stdout
