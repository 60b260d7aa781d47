"""Out of GPU memory: the job steps down to a smaller plan and trains the same model, or ends with exit 4 and what to change.

The out-of-memory error is CUDA's own exception class (torch.OutOfMemoryError), raised from the test side
(tests/faults/sitecustomize.py) by a training pass of more sequences than a limit, as a card too small for the
plan would; on CPU the planner picks 8 sequences x 1 pass, then 4 x 2, 2 x 4, 1 x 8 as it steps down.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import NO_EVALUATION, committed_steps, free_port, job_env, max_weight_difference, run_job, start_job, termination_message, wait_for, with_faults
from trainer.model import stepdown

# Max absolute weight difference between the stepped-down job's final weights and those of a job planned at the
# smaller layout from the start: only the summation order of the first steps' losses and gradients differs (fp32 on
# CPU), which AdamW turns into a small part of one update (lr 1e-3): measured 3.5e-6.  Two steps move the weights
# by 7.5e-4 (measured: checkpoint 2 against the final weights, checked below), so a step trained twice, skipped or
# on other rows fails here.
WEIGHT_TOLERANCE = 5e-5


def _settings(demo_assets, rows, **more: str) -> dict[str, str]:
    from trainer.data import demo

    rows.write_text("".join(json.dumps(row) + "\n" for row in demo.conversations(40, seed=7)))
    return dict(
        FT_MODEL=str(demo_assets / "model"), FT_DATASET=str(rows), FT_PLATFORM="none", FT_BATCH_SIZE="1", FT_GRADIENT_ACCUMULATION_STEPS="8",
        FT_MAX_STEPS="4", FT_LOGGING_STEPS="1", FT_EVAL_STEPS="2", FT_SAVE_STEPS="2", FT_WARMUP_STEPS="0", FT_LEARNING_RATE="1e-3",
    ) | NO_EVALUATION | more  # fmt: skip


def _final(out):
    return out / "final" / "model" / "model.safetensors"


@pytest.fixture(scope="module")
def planned_2x4(demo_assets, tmp_path_factory):
    """One process planned at 2 sequences x 4 passes from the start: the weights every stepped-down job here must end with.
    Two DDP processes at 2 x 2 each train the same 8 sequences per step: measured 2.4e-7 from it (tests/test_scale_out.py)."""
    folder = tmp_path_factory.mktemp("planned-2x4")
    settings = _settings(demo_assets, folder / "train.jsonl")
    smaller = folder / "volume"
    reference = run_job(job_env(smaller, **settings | {"FT_BATCH_LAYOUT": "as-set", "FT_BATCH_SIZE": "2", "FT_GRADIENT_ACCUMULATION_STEPS": "4"}), timeout=900)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    return smaller


@pytest.mark.slow
@pytest.mark.faults("out of GPU memory with a plan too large, after the first checkpoint")
def test_out_of_memory_steps_down_twice_and_ends_with_the_weights_of_the_smaller_plan(demo_assets, planned_2x4, tmp_path):
    settings = _settings(demo_assets, tmp_path / "train.jsonl")
    smaller = planned_2x4

    out = tmp_path / "stepped-down"
    # 8 x 1 trains steps 1-2 (checkpoint 2 committed), then its third pass runs out of memory; 4 x 2 resumes from
    # checkpoint 2 and runs out at once; 2 x 4 resumes from checkpoint 2 and finishes.
    result = run_job(with_faults(job_env(out, **settings), oom_above_sequences="2", oom_after_passes="2"), timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "memory plan: 8 sequences x 1 passes" in log
    downs = [line for line in log.splitlines() if "stepping down" in line]
    assert len(downs) == 2, log
    assert "with 8 sequences x 1 passes" in downs[0] and "to 4 sequences x 2 passes" in downs[0] and "measured peak" in downs[0]
    assert "with 4 sequences x 2 passes" in downs[1] and "to 2 sequences x 4 passes" in downs[1]
    assert log.count("resuming from") == 2 and "Traceback" not in log
    assert committed_steps(out) == [2, 4]
    assert max_weight_difference(_final(smaller), _final(out)) <= WEIGHT_TOLERANCE
    assert max_weight_difference(smaller / "checkpoints" / "checkpoint-2" / "model.safetensors", _final(out)) > 10 * WEIGHT_TOLERANCE  # two steps apart

    record = json.loads((out / ".fulltune" / "memory-plan.json").read_text())
    assert record["plan"] == [2, 4, 0]
    assert [failed["plan"] for failed in record["out_of_memory"]] == [[8, 1, 0], [4, 2, 0]]
    assert record["fit"]["measured_peak_bytes"] > 0 and record["fit"]["step"] == 3


# torchrun gives the workers it stops 30 s between its SIGTERM and its SIGKILL (torch 2.13's agent, `_stop_workers`): a rank
# held in an NCCL collective ignores the SIGTERM, so without the launcher ending it each step-down waited that long.
TORCHRUN_STOP_SECONDS = 30


@pytest.mark.slow
@pytest.mark.faults("out of GPU memory in cuBLAS, not torch's OutOfMemoryError, after the first checkpoint")
def test_a_cublas_out_of_memory_error_restarts_the_process_at_each_next_plan_and_ends_with_the_weights_of_the_smaller_plan(
    demo_assets, planned_2x4, tmp_path
):
    """cuBLAS (its handle, made at the first backward), cuDNN and NCCL say they ran out of device memory in a RuntimeError of
    their own words, not torch.OutOfMemoryError: the step-down takes them too, through a restart of the process (exit 75,
    and entrypoint.py starts it again at the recorded plan) rather than a retry in a process whose CUDA state is suspect."""
    settings = _settings(demo_assets, tmp_path / "train.jsonl")
    out = tmp_path / "stepped-down"
    env = job_env(out, **settings)
    result = run_job(with_faults(env, oom_above_sequences="2", oom_after_passes="2", oom_kind="cublas"), timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    restarts = [line for line in result.stdout.splitlines() if "restarting it there" in line]
    assert len(restarts) == 2, log
    assert restarts[0].startswith("fulltune: out of GPU memory in the training process with 8 sequences x 1 passes per process"), restarts
    assert "the next plan down, 2 sequences x 4 passes per process" in restarts[1], restarts
    assert log.count("fulltune: exit 75: out of GPU memory with") == 2 and "CUBLAS_STATUS_ALLOC_FAILED" in log
    assert "stepping down" not in log  # never retried inside the process that hit it
    assert committed_steps(out) == [2, 4] and termination_message(env).strip() == ""
    assert max_weight_difference(_final(planned_2x4), _final(out)) <= WEIGHT_TOLERANCE

    record = json.loads((out / ".fulltune" / "memory-plan.json").read_text())
    assert [failed["plan"] for failed in record["out_of_memory"]] == [[8, 1, 0], [4, 2, 0]] and record["plan"] == [2, 4, 0]
    assert all("CUBLAS_STATUS_ALLOC_FAILED" in failed["error"] for failed in record["out_of_memory"])


@pytest.mark.slow
@pytest.mark.faults("out of GPU memory on one of two processes, the other held in a collective")
def test_out_of_memory_on_one_of_two_processes_ends_the_waiting_one_at_once_restarts_both_at_the_next_plan_and_ends_0_with_the_weights_of_the_smaller_plan(
    demo_assets, planned_2x4, tmp_path
):
    settings = _settings(demo_assets, tmp_path / "train.jsonl", FT_NUM_PROCESSES="2", FT_DISTRIBUTED="ddp", FT_GRADIENT_ACCUMULATION_STEPS="4")
    out, held, log_file = tmp_path / "stepped-down", tmp_path / "held", tmp_path / "job.log"
    env = job_env(out, **settings, FT_MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    # Each process plans 4 sequences x 1 pass; rank 1 alone runs out in its third pass (after checkpoint 2); rank 0, in that
    # pass, blocks deaf to SIGTERM as a rank in an NCCL collective does.  The launcher ends it as soon as rank 1 has recorded
    # the step-down, and starts both again at 2 x 2, from checkpoint 2.
    job = start_job(with_faults(env, oom_above_sequences="2", oom_after_passes="2", oom_on_rank="1", hang_beside_oom=str(held)), log_file)
    wait_for(lambda: "restarting the 2 processes there" in log_file.read_text(), timeout=600, what="the restart at the next plan")
    took = time.time() - float(held.read_text().split()[0])
    assert job.wait(timeout=600) == 0, log_file.read_text()[-5000:]
    print(f"restarted {took:.1f} s after rank 0 blocked")
    assert took < TORCHRUN_STOP_SECONDS / 2, f"{took:.1f} s: the launcher waited for torchrun to end the blocked rank"
    log = log_file.read_text()
    lines = [line for line in log.splitlines() if "restarting the 2 processes there" in line]
    assert len(lines) == 1, log
    assert lines[0].startswith("fulltune: out of GPU memory on one of the 2 processes with 4 sequences x 1 passes per process, recomputation off"), lines
    assert "the next plan down, 2 sequences x 2 passes per process, recomputation off, is recorded in" in lines[0], lines[0]
    assert "starting at the plan an earlier attempt stepped down to after running out of memory: 2 processes (ddp" in log
    assert f"resuming from {out}/checkpoints/checkpoint-2" in log
    assert committed_steps(out) == [2, 4]
    assert termination_message(env).strip() == ""  # the stepped-down attempt's exit lines do not outlive the job that finished
    assert max_weight_difference(planned_2x4 / "final" / "model" / "model.safetensors", _final(out)) <= WEIGHT_TOLERANCE  # measured 3.2e-6
    assert max_weight_difference(planned_2x4 / "checkpoints" / "checkpoint-2" / "model.safetensors", _final(out)) > 10 * WEIGHT_TOLERANCE

    record = json.loads((out / ".fulltune" / "memory-plan.json").read_text())
    assert [failed["plan"] for failed in record["out_of_memory"]] == [[4, 1, 0]] and record["plan"] == [2, 2, 0]
    assert record["fit"]["step"] == 3 and record["fit"]["measured_peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.faults("out of GPU memory at the smallest plan")
def test_out_of_memory_at_the_smallest_plan_exits_4_with_the_peak_and_what_to_change_and_the_restart_starts_small(demo_assets, tmp_path):
    settings = _settings(demo_assets, tmp_path / "train.jsonl", FT_MAX_STEPS="2")
    out = tmp_path / "volume"
    env = job_env(out, **settings)
    result = run_job(with_faults(env, oom_above_sequences="0"), timeout=900)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    message = termination_message(env)
    assert message.startswith("exit 4: out of GPU memory at the smallest plan these settings allow (1 sequences x 8 passes"), message
    for fix in ("measured peak", "FT_MAX_LENGTH=", "FT_NUM_PROCESSES=2 FT_DISTRIBUTED=fsdp"):
        assert fix in message, message
    assert "FT_PRECISION=bf16-sr" not in message  # offered for bf16-mixed only: this CPU job trains in fp32
    assert result.stdout.count("stepping down") == 3
    assert committed_steps(out) == []

    restarted = run_job(env, timeout=900)  # the card is as small as before: start at the plan the descent reached
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    assert "starting at the plan an earlier attempt stepped down to after running out of memory: 1 sequences x 8 passes" in restarted.stdout


def test_the_next_plan_down_recomputes_more_before_it_runs_more_passes():
    """On a card, the descent from a plan goes to more recomputation at the same passes first, then to more passes."""
    from trainer.core import settings as settings_table
    from trainer.core.config import PRECISIONS
    from trainer.model import loading, memory

    settings = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused"})
    config = _qwen3_4b()
    n_params = loading.parameter_count(config)
    plans = memory.candidates(config, n_params, settings, PRECISIONS["bf16-mixed"], 141e9, settings.activation_checkpointing, 1, "none")  # an H200
    chain = [plans[0]]  # a plan for a larger card: 8 sequences in one pass, nothing recomputed
    while (lower := stepdown.next_down(chain[-1], plans)) is not None:
        chain.append(lower)
    assert len(chain) > 3  # the layout decides (a second pass keeps autocast's copies alive: its estimate can be higher)
    assert all((b.sequences_per_pass, b.checkpoint_every, b.offload) != (a.sequences_per_pass, a.checkpoint_every, a.offload)
               for a, b in zip(chain, chain[1:], strict=False))
    assert all(b.peak < a.peak for a, b in zip(chain, chain[1:], strict=False))  # each a lower planned peak, here where one is left
    # the bottom: one sequence per pass, every layer recomputed, its input offloaded to host memory (a GPU's lever)
    assert (chain[-1].sequences_per_pass, chain[-1].checkpoint_every, chain[-1].offload) == (1, 1, True)
    assert [p.passes_per_step for p in chain] == sorted(p.passes_per_step for p in chain)  # passes never go back up
    assert (chain[0].checkpoint_every, chain[1].passes_per_step) == (0, 1) and chain[1].checkpoint_every > 0  # first: recompute some layers, same passes


def _qwen3_4b():
    from pathlib import Path

    from transformers import Qwen3Config

    return Qwen3Config.from_json_file(Path(__file__).resolve().parents[1] / "bench" / "qwen3-4b-config.json")
