"""The registered demo model behind real servers, asked the way OpenAI-style chat clients ask: `mlflow models serve`
(POST /invocations, over plain HTTP) and `python -m trainer.serving.openai_server` (transformers serve, through the
official `openai` package with a plain base_url); the answers are compared with what transformers generates from the
same weights."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import DEMO_NAME, ROOT, assert_answers_as_transformers_does, free_port, greedy_reply, wait_for

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
    status, response = chat(url, stream=True)
    assert status == 400 and "stream" in response["message"] and "python -m trainer.serving.openai_server" in response["message"]


# -- The OpenAI-compatible server: transformers serve on the registered model's folder -------------------------------


def serve_command(model: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "trainer.serving.openai_server", model, *options]


def serving_env(out: Path, **extra: str) -> dict[str, str]:
    return ({k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
            | {"MLFLOW_TRACKING_URI": f"sqlite:///{out}/mlflow/mlflow.db", "HF_HUB_OFFLINE": "1"} | extra)


@pytest.mark.faults("a models:/ URI without MLFLOW_TRACKING_URI")
def test_a_registered_model_without_a_tracking_uri_exits_2_saying_which_store_to_name_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run(serve_command(f"models:/{DEMO_NAME}/1"), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MLFLOW_TRACKING_URI is not set" in result.stderr and "MLFLOW_TRACKING_URI=sqlite:///$PWD/out/mlflow/mlflow.db" in result.stderr
    assert list(tmp_path.iterdir()) == [], "no empty mlflow.db (or mlruns/) where it was started"


@pytest.fixture(scope="module")
def openai_served(demo_job_run, tmp_path_factory):
    """`python -m trainer.serving.openai_server models:/<demo model>/1` on a free loopback port: (an `openai.OpenAI`
    client with a plain base_url, the final weights' folder)."""
    out, _ = demo_job_run
    port, log = free_port(), tmp_path_factory.mktemp("openai-serve") / "serve.log"
    command = serve_command(f"models:/{DEMO_NAME}/1", "--host", "127.0.0.1", "--port", str(port))
    with open(log, "w") as handle:
        server = subprocess.Popen(command, env=serving_env(out), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert server.poll() is None, log.read_text()
        try:
            return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout=240, what="the OpenAI-compatible server")
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0), out / "final" / "model"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        print(log.read_text()[-2000:])


CONVERSATION = [
    {"role": "system", "content": "You reverse lists of words."},
    {"role": "user", "content": "Reverse: one two"},
    {"role": "assistant", "content": "two one"},
    {"role": "user", "content": PROMPT},
]


def greedy_ids(model_dir: Path, messages: list[dict], max_new_tokens: int) -> tuple[int, list[int]]:
    """The prompt's length and the reply's token ids, as transformers generates them greedily for `messages`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return prompt["input_ids"].shape[1], output[0, prompt["input_ids"].shape[1] :].tolist()


def as_served(model_dir: Path, ids: list[int]) -> str:
    """The reply's text as transformers serve writes it: it reads a Qwen3 answer with its response parser (for
    `<think>` and tool calls), on the text with special tokens kept (vLLM drops them; a trained model writes none
    before its `<|im_end|>`), and the parser's close pattern ends the content at the closing `<|im_end|>`, which
    the demo, trained to answer and stop, writes."""
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=False)
    return re.sub(r"\s*(?:<\|im_end\|>|<\|endoftext\|>)$", "", text)


@pytest.mark.slow  # the demo job and transformers serve in subprocesses
def test_the_openai_client_lists_the_registered_model_and_gets_the_greedy_reply_of_the_whole_conversation(openai_served):
    client, weights = openai_served
    assert [model.id for model in client.models.list()] == [DEMO_NAME]

    response = client.chat.completions.create(model=DEMO_NAME, messages=CONVERSATION, temperature=0, max_tokens=8)
    prompt_tokens, reply = greedy_ids(weights, CONVERSATION, 8)
    print(f"served {response.choices[0].message.content!r}, transformers {as_served(weights, reply)!r}")
    assert response.model == DEMO_NAME and response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == as_served(weights, reply).strip()  # the whole answer is stripped
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, len(reply))  # every turn reached the model
    assert response.choices[0].finish_reason == ("length" if len(reply) == 8 else "stop")


@pytest.mark.slow  # the demo job and transformers serve in subprocesses
def test_stream_true_sends_the_same_greedy_reply_in_pieces_with_the_usage_last(openai_served):
    client, weights = openai_served
    chunks = list(client.chat.completions.create(model=DEMO_NAME, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=8, stream=True))
    pieces = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    reply = greedy_reply(weights, PROMPT, 8)
    print(f"pieces {pieces!r}")
    assert len(pieces) > 1 and "".join(pieces) == as_served(weights, reply)
    assert all(chunk.object == "chat.completion.chunk" and chunk.model == DEMO_NAME for chunk in chunks)
    assert chunks[-1].usage.completion_tokens == len(reply) and chunks[-1].choices[0].finish_reason == ("length" if len(reply) == 8 else "stop")


@pytest.mark.slow  # the demo job and transformers serve in subprocesses
def test_a_client_asking_for_another_model_gets_400_naming_the_served_one(openai_served):
    client, _ = openai_served
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
    detail = refused.value.response.json()["detail"]  # FastAPI's error body (the client's own message shows only the code)
    assert DEMO_NAME in detail and "gpt-4o-mini" in detail


@pytest.mark.faults("a served model that is not registered", "a served folder that is not a model", "a registry that does not answer when serving")
@pytest.mark.slow  # the demo job's registry
def test_serving_what_cannot_be_served_exits_2_saying_what_to_give_and_a_registry_not_answering_exits_1_without_its_password(demo_job_run, tmp_path):
    out, _ = demo_job_run
    cases = (
        (f"models:/{DEMO_NAME}/7", f"models:/{DEMO_NAME}/7: Model Version (name={DEMO_NAME}, version=7) not found",
         "the job registers models:/<FT_REGISTERED_MODEL>/<version>"),
        (str(tmp_path), f"{tmp_path}: {tmp_path} has no config.json", "give the job's final/ or final/model/ folder"),
    )
    for model, says, fix in cases:
        result = subprocess.run(serve_command(model), env=serving_env(out), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert says in result.stderr and fix in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1

    away = serving_env(out, MLFLOW_TRACKING_URI=f"http://user:s3cret@127.0.0.1:{free_port()}", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    result = subprocess.run(serve_command(f"models:/{DEMO_NAME}/1"), env=away, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the registry http://****@127.0.0.1" in result.stderr and "s3cret" not in result.stdout + result.stderr


@pytest.mark.slow  # the demo job
def test_final_model_is_a_plain_transformers_folder_with_what_vllm_reads_and_nothing_of_mlflow(demo_job_run):
    out, _ = demo_job_run
    folder = out / "final" / "model"
    assert sorted(p.name for p in folder.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]  # the class vLLM maps to its own
