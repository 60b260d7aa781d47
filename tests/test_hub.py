"""A hub that does not answer ends the job in seconds with exit 1, naming the id and how to run offline."""

from __future__ import annotations

import socket
import time

import pytest

from conftest import job_env, run_job, termination_message

CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens there


def hub_env(out, endpoint: str, **settings: str) -> dict[str, str]:
    env = job_env(out, HF_ENDPOINT=endpoint, HF_HOME=str(out.parent / "hf-home"), **settings)  # an empty cache
    del env["HF_HUB_OFFLINE"]
    return env


@pytest.mark.faults
@pytest.mark.parametrize("variable", ["FT_MODEL", "FT_DATASET"])
def test_an_unreachable_hub_exits_1_within_seconds_naming_the_id_and_how_to_run_offline(variable, demo_assets, tmp_path):
    ids = {"FT_MODEL": "Qwen/Qwen3-0.6B", "FT_DATASET": "trl-lib/Capybara"}
    local = {"FT_MODEL": str(demo_assets / "model"), "FT_DATASET": str(demo_assets / "data" / "train.jsonl")}
    out = tmp_path / "volume"
    env = hub_env(out, CLOSED_PORT, **(local | {variable: ids[variable]}))
    started = time.monotonic()
    result = run_job(env, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"exit 1: {variable}={ids[variable]!r}: the Hugging Face hub at {CLOSED_PORT} is unreachable (ConnectError" in result.stderr
    assert "set HF_HUB_OFFLINE=1" in result.stderr and f"{variable}=<" in result.stderr and "Traceback" not in result.stderr
    assert "the Hugging Face hub" in termination_message(env)
    assert not out.exists() or not any(out.iterdir()), "nothing is written before the hub answers (entrypoint.py only checked the folder is writable)"
    print(f"{variable}: exit 1 after {elapsed:.1f} s")
    assert elapsed < 30, elapsed  # huggingface_hub's own retries alone took 23 s per id, 52 s for a dataset


@pytest.mark.faults("a hub that accepts connections but never answers")
def test_a_hub_that_accepts_but_never_answers_is_given_up_after_the_hub_timeout(demo_assets, tmp_path):
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads the request
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = hub_env(tmp_path / "volume", endpoint, FT_MODEL="Qwen/Qwen3-0.6B", FT_DATASET=str(demo_assets / "data" / "train.jsonl"), HF_HUB_ETAG_TIMEOUT="1")
        started = time.monotonic()
        result = run_job(env, timeout=120)
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the Hugging Face hub at {endpoint} is unreachable (ReadTimeout" in result.stderr and "3 tries in" in result.stderr
    print(f"silent hub: exit 1 after {elapsed:.1f} s")
    assert elapsed < 30, elapsed
