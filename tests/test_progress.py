"""The progress line: one parseable line per logging step, the same numbers in MLflow."""

from __future__ import annotations

import pytest

from tests.conftest import NO_EVALUATION, job_env, run_job
from trainer.console import progress


def test_progress_line_round_trips():
    line = progress.format_line({"step": "20/50", "loss": 2.34, "lr": 1.2e-05, "tokens_per_s": 15234.2, "mfu": 0.47, "mem_gb": 61.2, "eta_s": 812.0})
    assert line == "fulltune: step=20/50 loss=2.3400 lr=1.2e-05 tokens_per_s=15234 mfu=0.470 mem_gb=61.2 eta_s=812"
    expected = {"step": "20/50", "loss": "2.3400", "lr": "1.2e-05", "tokens_per_s": "15234", "mfu": "0.470", "mem_gb": "61.2", "eta_s": "812"}
    assert progress.parse_line(line) == expected


def test_mfu_counts_qwen3_4b_as_27_8_gflop_per_token_at_2048():
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, tie_word_embeddings=True)
    assert progress.flops_per_token(config, 4_022_468_096, 2048) == pytest.approx(27.76e9, rel=0.005)
    assert progress.peak_flops("NVIDIA H200") == 989e12 and progress.peak_flops("Some CPU") is None


def test_tokens_per_s_counts_only_the_time_inside_optimizer_steps_and_the_tokens_since_the_last_line(monkeypatch, capsys):
    """An evaluation (or a save) between two steps takes wall time but trains no token: it must not lower tokens/s.
    The clock is the test's, so the expected rate is computed here, independently: 3,000 tokens in 2 x 1.5 s of steps."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    logged = []
    tracker = SimpleNamespace(log_metrics=lambda values, step: logged.append((step, values)))
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    callback = progress.Progress(tracker, config, 10_000, sequences_per_step=8, cuda=False)
    state, control = SimpleNamespace(global_step=0, max_steps=10), SimpleNamespace(should_log=False)
    callback.on_train_begin(None, state, control)
    callback.on_log(None, state, control, logs={"loss": 3.0, "num_tokens": 500.0})  # the first line: tokens before it are not this window's
    for seconds_in_step, seconds_outside in [(1.5, 40.0), (1.5, 0.0)]:  # 40 s of evaluation after the first step
        callback.on_step_begin(None, state, control)
        now[0] += seconds_in_step
        state.global_step += 1
        callback.on_step_end(None, state, control)
        now[0] += seconds_outside
    callback.on_log(None, state, control, logs={"loss": 2.5, "num_tokens": 3_500.0, "learning_rate": 1e-5})
    line = progress.parse_line(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["tokens_per_s"] == "1000" and logged[-1] == (2, {"tokens_per_s": 1000.0, "mem_gb": logged[-1][1]["mem_gb"], "eta_s": logged[-1][1]["eta_s"]})


@pytest.mark.slow
def test_every_logging_step_prints_a_progress_line_and_logs_it_to_mlflow(tmp_path):
    env = job_env(tmp_path / "out", FT_PRESET="demo", FT_MAX_STEPS="10", FT_EVAL_STEPS="10", FT_SAVE_STEPS="10", FT_LOGGING_STEPS="5", FT_REGISTERED_MODEL="",
                  **NO_EVALUATION)
    result = run_job(env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [progress.parse_line(line) for line in result.stdout.splitlines() if line.startswith("fulltune: step=") and " loss=" in line]
    assert [line["step"] for line in lines] == ["5/10", "10/10"]
    for line in lines:
        assert float(line["loss"]) > 0 and float(line["tokens_per_s"]) > 0 and float(line["mem_gb"]) > 0 and float(line["eta_s"]) >= 0
        assert "mfu" not in line  # CPU: no peak to compare with

    import mlflow

    mlflow.set_tracking_uri(_tracking_uri(tmp_path / "out"))
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list")
    history = mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, "tokens_per_s")
    assert [m.step for m in history] == [5, 10]



def _tracking_uri(output_dir):
    """The job's embedded MLflow store (trainer/tracking.configure)."""
    return f"sqlite:///{output_dir}/mlflow/mlflow.db"
