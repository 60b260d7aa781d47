"""The registered demo model behind a real `mlflow models serve`, asked over HTTP the way OpenAI-style chat
clients ask; the answers are compared with what transformers generates from the same weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import DEMO_NAME, assert_answers_as_transformers_does, free_port, greedy_reply, wait_for

PROMPT = "Reverse: apple river stone"


@pytest.fixture(scope="module")
def served(demo_job_run, tmp_path_factory):
    """`mlflow models serve -m models:/<demo model>/1` on a free loopback port: (URL, the final weights' folder)."""
    out, _ = demo_job_run
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {
        "MLFLOW_TRACKING_URI": f"sqlite:///{out}/mlflow/mlflow.db",
        "HF_HUB_OFFLINE": "1",
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),  # MLflow execs `uvicorn` by name
    }
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{DEMO_NAME}/1", "--env-manager", "local",
               "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as handle:
        server = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)  # its own group: uvicorn is a child
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert server.poll() is None, log.read_text()
        try:
            return urllib.request.urlopen(f"{url}/ping", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout=240, what="mlflow models serve")
        yield url, out / "final" / "model"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def chat(url: str, **request) -> tuple[int, dict]:
    """POST an OpenAI chat request to /invocations; the HTTP status and the JSON body."""
    body = json.dumps({"model": "any", "messages": [{"role": "user", "content": PROMPT}]} | request).encode()
    call = urllib.request.Request(f"{url}/invocations", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def prompt_length(model_dir: Path, text: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return len(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def decoded(model_dir: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


@pytest.mark.slow  # the demo job and an MLflow scoring server in subprocesses
def test_temperature_0_answers_the_greedy_reply_transformers_generates_named_by_the_registered_model(served):
    url, weights = served
    status, response = chat(url, temperature=0, max_tokens=8)
    assert status == 200, response
    assert_answers_as_transformers_does(response, weights, PROMPT, 8, name=DEMO_NAME)
    usage = response["usage"]
    assert usage["prompt_tokens"] == prompt_length(weights, PROMPT) and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert response["id"].startswith("chatcmpl-")


@pytest.mark.slow  # the demo job and an MLflow scoring server in subprocesses
def test_max_tokens_bounds_the_answer_and_a_stop_string_cuts_it_before_the_stop(served):
    url, weights = served
    reply = greedy_reply(weights, PROMPT, 16)
    full = decoded(weights, reply)
    stop = next(full[i : i + 2] for i in range(len(full) - 2, 0, -1) if full[i : i + 2].isalpha())  # two letters late in the answer
    print(f"greedy answer {full!r}, stop {stop!r}")

    status, response = chat(url, temperature=0, max_tokens=3)
    assert status == 200, response
    assert response["choices"][0]["message"]["content"] == decoded(weights, reply[:3])
    assert response["usage"]["completion_tokens"] == 3 and response["choices"][0]["finish_reason"] == "length"

    status, response = chat(url, temperature=0, max_tokens=16, stop=stop)  # one string, as OpenAI allows, not only a list
    assert status == 200, response
    assert response["choices"][0]["message"]["content"] == full[: full.find(stop)]
    assert response["choices"][0]["finish_reason"] == "stop" and response["usage"]["completion_tokens"] < 16


@pytest.mark.slow  # the demo job and an MLflow scoring server in subprocesses
def test_temperature_above_0_samples_and_top_p_narrows_the_choice(served):
    url, weights = served
    greedy = decoded(weights, greedy_reply(weights, PROMPT, 8))
    sampled = []
    for _ in range(3):
        status, response = chat(url, temperature=2, max_tokens=8)  # an integer, as clients send it
        assert status == 200, response
        assert response["usage"]["completion_tokens"] <= 8
        sampled.append(response["choices"][0]["message"]["content"])
    assert any(answer != greedy for answer in sampled), "temperature 2 samples"
    status, response = chat(url, temperature=1.0, top_p=0.0, max_tokens=8)  # only the most likely token left at each step
    assert status == 200, response
    assert response["choices"][0]["message"]["content"] == greedy


@pytest.mark.faults("chat requests with values out of range")
@pytest.mark.slow  # the demo job and an MLflow scoring server in subprocesses
def test_a_value_out_of_range_gets_400_naming_the_field_without_a_stack_trace(served):
    url, _ = served
    for request, field in (({"temperature": 3}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens")):
        status, response = chat(url, **request)
        assert status == 400, (request, response)
        assert field in response["message"] and "Traceback" not in json.dumps(response) and "stack_trace" not in response
