"""The MLflow server goes away: at start, mid-run for longer than MLflow's own retries last, and until the end.

Each case runs the demo job through entrypoint.py against a real `mlflow server` on loopback, killed with
SIGKILL and started again on the same port and store.  MLflow's own retries are made short here
(MLFLOW_HTTP_REQUEST_MAX_RETRIES=1: a refused call fails within a second) so that an outage of 25 s
outlasts them by far; at MLflow's defaults a call retries for about four minutes instead, in the
background thread, which the training never waits for either.
"""

from __future__ import annotations

import json
import re
import socket
import time

import mlflow
import pytest

from conftest import MlflowServer, free_port, job_env, run_job, start_job, termination_message, wait_for, with_faults

DEMO_NAME = "demo.default.tiny_qwen3_assistant"
SHORT_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
DOWN = "not answering since"
BACK = "tracking server back"


def server_env(out, server: MlflowServer, **settings: str) -> dict[str, str]:
    uri = server.url.replace("http://", "http://ci:pw-do-not-leak@")  # the server ignores basic auth; the password must not show
    return job_env(out, FT_PRESET="demo", MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="outage", **SHORT_RETRIES, **settings)


def the_run(server: MlflowServer):
    mlflow.set_tracking_uri(server.url)
    runs = mlflow.search_runs(experiment_names=["outage"], output_format="list")
    assert len(runs) == 1
    return runs[0]


def logged_steps(server: MlflowServer, run, metric: str) -> list[int]:
    return sorted(m.step for m in mlflow.MlflowClient(server.url).get_metric_history(run.info.run_id, metric))


def wait_for_line(log, text: str, job, timeout: float = 240) -> None:
    wait_for(lambda: text in log.read_text() or job.poll() is not None, timeout=timeout, what=text)
    assert text in log.read_text(), log.read_text()


@pytest.mark.faults
@pytest.mark.slow  # an MLflow server and the demo job (20 steps of at least 1.5 s) in subprocesses
@pytest.mark.parametrize("retries", ["short", "mlflow-defaults"])
def test_a_server_down_mid_run_loses_no_metric_and_the_job_finishes(retries, tmp_path):
    """`short`: down 25 s, far longer than MLflow's retries here, so one line says so and the outbox waits it out.
    `mlflow-defaults`: down 10 s, within the four minutes MLflow's own retries last; the training does not wait for them."""
    server = MlflowServer(tmp_path).start()
    out, log = tmp_path / "volume", tmp_path / "job.log"
    env = server_env(out, server, FT_MAX_STEPS="20")
    if retries == "mlflow-defaults":
        env = {k: v for k, v in env.items() if k not in SHORT_RETRIES}
    job = start_job(with_faults(env, seconds_per_step=1.5), log)
    try:
        wait_for_line(log, "step=5/20", job)
        server.kill()
        killed = time.monotonic()
        if retries == "short":
            wait_for_line(log, DOWN, job, timeout=60)
        time.sleep(max(0.0, (25 if retries == "short" else 10) - (time.monotonic() - killed)))
        server.start()
        job.wait(timeout=600)
    finally:
        job.kill()
    text = log.read_text()
    assert job.returncode == 0, text
    assert text.count(DOWN) == text.count(BACK) <= 1, text  # one line for the outage, not one per step, and one when it ends
    if retries == "short":
        # the first value that found no answer: a system metric (tagged with the last step) or step 10's log line
        assert text.count(DOWN) == 1 and re.search(r"tracking server back \(down since step (?:[5-9]|10)\): \d+ buffered values sent", text), text
    assert f"registered {DEMO_NAME}/1" in text and "pw-do-not-leak" not in text
    run = the_run(server)
    assert run.info.status == "FINISHED"
    for metric in ("loss", "grad_norm", "learning_rate", "tokens_per_s"):
        assert logged_steps(server, run, metric) == [5, 10, 15, 20], metric
    assert logged_steps(server, run, "eval_loss") == [20]
    artifacts = [f.path for f in mlflow.MlflowClient(server.url).list_artifacts(run.info.run_id)]
    assert artifacts == ["data", "eval_samples.json", "evaluation", "model", "model_metadata.json", "report.html"]  # evaluation/: the stage after training
    assert mlflow.MlflowClient(server.url).get_model_version(DEMO_NAME, "1").run_id == run.info.run_id
    assert not (out / ".fulltune" / "unsent-tracking.json").exists()
    server.kill()


@pytest.mark.faults("a tracking server still down at registration")
@pytest.mark.slow  # an MLflow server and the demo job twice, in subprocesses
def test_a_server_still_down_at_the_end_exits_3_keeping_the_model_and_the_metrics_and_a_retry_sends_them_and_registers(tmp_path):
    server = MlflowServer(tmp_path).start()
    out, log = tmp_path / "volume", tmp_path / "job.log"
    steps = {"FT_MAX_STEPS": "10", "FT_EVAL_STEPS": "10", "FT_SAVE_STEPS": "10", "FT_LOGGING_STEPS": "2"}
    env = server_env(out, server, FT_REGISTRATION_RETRY_SECONDS="12", **steps)
    job = start_job(with_faults(env, seconds_per_step=0.5), log)
    try:
        wait_for_line(log, "step=4/10", job)
        server.kill()
        started_waiting = time.monotonic()
        job.wait(timeout=600)
    finally:
        job.kill()
    text = log.read_text()
    assert job.returncode == 3, text
    assert text.count(DOWN) == 1, text
    assert time.monotonic() - started_waiting < 120, "the end waits FT_REGISTRATION_RETRY_SECONDS, not MLflow's minutes"
    assert f"the trained model is saved at {out}/final" in text and "FT_REGISTRATION_RETRY_SECONDS=12" in text and "exit 3" in termination_message(env)
    assert "pw-do-not-leak" not in text + termination_message(env)
    assert (out / "final" / "model" / "model.safetensors").exists()
    kept = json.loads((out / ".fulltune" / "unsent-tracking.json").read_text())
    assert {m[3] for item in kept if item["kind"] == "metrics" for m in item["metrics"] if m[0] == "loss"} >= {6, 8, 10}

    server.start()
    retry = run_job(env)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "starting from step" not in retry.stdout and "resuming" not in retry.stdout  # no training
    assert f"registered {DEMO_NAME}/1" in retry.stdout
    run = the_run(server)
    assert run.info.status == "FINISHED"
    assert logged_steps(server, run, "loss") == [2, 4, 6, 8, 10]
    assert logged_steps(server, run, "eval_loss") == [10]
    assert not (out / ".fulltune" / "unsent-tracking.json").exists()
    server.kill()


@pytest.mark.faults
@pytest.mark.parametrize("server", ["refusing", "silent"])
def test_a_tracking_server_that_does_not_answer_at_start_exits_1_within_seconds_before_anything_is_written(server, tmp_path):
    out = tmp_path / "volume"
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1] if server == "silent" else free_port()
        env = job_env(out, FT_PRESET="demo", MLFLOW_TRACKING_URI=f"http://ci:pw-do-not-leak@127.0.0.1:{port}")
        started = time.monotonic()
        result = run_job(env, timeout=120)
        took = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"MLFLOW_TRACKING_URI=http://****@127.0.0.1:{port}: the MLflow tracking server does not answer" in result.stderr
    assert "Traceback" not in result.stderr and "exit 1" in termination_message(env)
    assert "pw-do-not-leak" not in result.stdout + result.stderr + termination_message(env)
    assert took < 60, took  # the tries take 3 s (refused) or 9 s (silent); the rest is starting Python twice on a busy machine
    assert not out.exists() or {p.name for p in out.iterdir()} <= {".fulltune"}, list(out.iterdir())
