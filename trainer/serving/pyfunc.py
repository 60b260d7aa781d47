"""The saved model's chat endpoint: an MLflow pyfunc model, saved "from code", that answers OpenAI-style
chat.completions requests with the transformers folder beside it (`model/`, the job's one copy of the weights).

    mlflow models serve -m models:/<name>/<version> --env-manager local
    POST /invocations {"messages": [...], "temperature": 0, "max_tokens": 64, "top_p": 0.9, "stop": ["\\n\\n"]}

Why not MLflow's transformers flavor (task llm/v1/chat): it hands the request's fields
to the text-generation pipeline unchanged (mlflow/transformers/llm_inference_utils.py, preprocess_llm_inference_input).
The pipeline samples unless the model's generation_config.json says otherwise, so `temperature: 0`, what most
clients send for a deterministic answer, reaches transformers' TemperatureLogitsWarper, which refuses it: HTTP 400
with a stack trace.  The flavor has no hook to map it to greedy decoding.  It also names the model in every
response by the folder it was trained from, loads a second, slow tokenizer by that same name for `stop` (a path or
hub id the serving machine may not have), leaves the stop string in the answer, and answers with a list rather than
a chat.completion object.  MLflow's ChatModel class is deprecated since MLflow 3.0 in favour of ResponsesAgent, which
speaks the Responses API rather than chat.completions; what MLflow recommends for a model with its own request
handling is a PythonModel saved from code, which this is.

This file runs inside the serving process: MLflow copies it into the saved model, so it imports only mlflow, pandas,
torch and transformers, nothing of fulltune.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types.llm import CHAT_MODEL_INPUT_SCHEMA, CHAT_MODEL_OUTPUT_SCHEMA
from mlflow.types.schema import AnyType, ColSpec, DataType, Schema

WEIGHTS = "model"  # the transformers folder inside the saved MLflow model
MODEL_NAME_KEY = "served_model_name"  # model_config: the name every response gives as `model`
# MLflow's chat request schema, with two changes: it names `max_completion_tokens`, which newer OpenAI clients send
# instead of `max_tokens` (fields the signature leaves out never reach predict), and it takes the numbers and `stop`
# as they come, checked here instead: MLflow's schema check turns away an integer for a double (`"temperature": 2`)
# and a single string for `stop`, both valid OpenAI requests.
_AS_SENT = {"temperature", "top_p", "frequency_penalty", "presence_penalty", "stop"}
SIGNATURE = ModelSignature(
    inputs=Schema(
        [ColSpec(AnyType(), spec.name, required=False) if spec.name in _AS_SENT else spec for spec in CHAT_MODEL_INPUT_SCHEMA.inputs]
        + [ColSpec(DataType.long, "max_completion_tokens", required=False)]
    ),
    outputs=CHAT_MODEL_OUTPUT_SCHEMA,
)
INPUT_EXAMPLE = {"messages": [{"role": "user", "content": "Hello!"}], "temperature": 0, "max_tokens": 64}


class ChatCompletions(mlflow.pyfunc.PythonModel):
    """OpenAI chat.completions on transformers' `generate`.  A field a request leaves out takes the value in the
    model's generation_config.json, as vLLM does; `temperature: 0` is greedy decoding."""

    def load_context(self, context):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), WEIGHTS)  # MLflow runs this file from inside the saved model
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").to("cuda" if torch.cuda.is_available() else "cpu").eval()
        self.name = (context.model_config or {}).get(MODEL_NAME_KEY) or "model"

    def predict(self, context, model_input: pd.DataFrame, params=None):
        import torch

        request = _request(model_input) | (params or {})
        prompt = self.tokenizer.apply_chat_template(_messages(request), add_generation_prompt=True, return_tensors="pt", return_dict=True)
        prompt = prompt.to(self.model.device)
        prompt_length = prompt["input_ids"].shape[1]
        room = getattr(self.model.config, "max_position_embeddings", 32768) - prompt_length
        options, stop = _generation_options(request, self.model.generation_config, room), _stop_strings(request)
        with torch.inference_mode():
            output = self.model.generate(**prompt, **options, **({"stop_strings": stop, "tokenizer": self.tokenizer} if stop else {}))
        reply = output[0, prompt_length:].tolist()
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=None)  # OpenAI leaves the stop string out
        cut_short = cut is None and len(reply) == options["max_new_tokens"] and reply[-1] not in _eos_ids(self.model.generation_config)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text[:cut]},
                    "finish_reason": "length" if cut_short else "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt_length, "completion_tokens": len(reply), "total_tokens": prompt_length + len(reply)},
        }


def _request(model_input: Any) -> dict[str, Any]:
    """The request's fields: `mlflow models serve` hands over a one-row DataFrame (the signature's columns, None or
    NaN where a field was left out); so does `pyfunc.load_model(...).predict(dict)`."""
    if isinstance(model_input, pd.DataFrame):
        if len(model_input) != 1:
            raise MlflowException.invalid_parameter_value(f"one chat request at a time, got {len(model_input)}")
        model_input = model_input.to_dict(orient="records")[0]
    if not isinstance(model_input, dict):
        raise MlflowException.invalid_parameter_value(f"a chat request is a JSON object with `messages`, got {type(model_input).__name__}")
    return {key: value for key, value in model_input.items() if value is not None and not (isinstance(value, float) and value != value)}


def _messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    messages = request.get("messages")
    if not messages:
        raise MlflowException.invalid_parameter_value("`messages` must list at least one message")
    return [{key: value for key, value in dict(message).items() if value is not None} for message in messages]


def _generation_options(request: dict[str, Any], defaults: Any, room: int) -> dict[str, Any]:
    """transformers `generate` arguments for an OpenAI request, or a 400 naming the field."""
    unsupported = {
        "n": request.get("n", 1) != 1,
        "stream": bool(request.get("stream")),
        "tools": bool(request.get("tools")),
        "frequency_penalty": bool(request.get("frequency_penalty")),
        "presence_penalty": bool(request.get("presence_penalty")),
    }
    if named := [name for name, asked in unsupported.items() if asked]:
        raise MlflowException.invalid_parameter_value(
            f"not supported by this endpoint: {', '.join(named)} (one non-streamed answer, no tools, no penalties); an OpenAI-compatible "
            "server on the same model streams: python -m trainer.serving.openai_server, or vLLM on its model/ folder "
            "(docs/tracking-and-serving.md#serving-the-trained-model)"
        )
    max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
    options: dict[str, Any] = {"max_new_tokens": _bounded(max_tokens, "max_tokens", 1, room) if max_tokens is not None else room}
    if options["max_new_tokens"] < 1:
        raise MlflowException.invalid_parameter_value(f"the prompt fills the model's context ({room} tokens left)")
    temperature = request.get("temperature")
    if temperature is not None and _bounded(temperature, "temperature", 0, 2) == 0:
        options["do_sample"] = False  # greedy: transformers refuses temperature 0 (it divides the logits by it)
    elif temperature is not None:
        options |= {"do_sample": True, "temperature": float(temperature)}
    if "top_p" in request:
        options["top_p"] = float(_bounded(request["top_p"], "top_p", 0, 1) or 1e-9)  # top_p 0 keeps the most likely token, as in vLLM
    if "top_k" in request:
        options["top_k"] = int(_bounded(request["top_k"], "top_k", 1, None))
    if not options.get("do_sample", defaults.do_sample):
        options |= {"temperature": None, "top_p": None, "top_k": None}  # greedy ignores them (transformers would warn)
    return options


def _stop_strings(request: dict[str, Any]) -> list[str]:
    """OpenAI's `stop`: one string or up to four."""
    stop = request.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise MlflowException.invalid_parameter_value(f"`stop` must be a string or a list of up to 4 non-empty strings, got {request['stop']!r}")
    return stop


def _bounded(value: Any, field: str, low: float, high: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (high is not None and value > high):
        raise MlflowException.invalid_parameter_value(f"`{field}` must be a number from {low} to {high if high is not None else 'up'}, got {value!r}")
    return value


def _eos_ids(generation_config: Any) -> set[int]:
    eos = generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


mlflow.models.set_model(ChatCompletions())
