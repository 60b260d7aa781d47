"""Row formats: detect which one a dataset uses, check every row, convert it to one internal form.

The internal form is a conversation, `{"messages": [{"role", "content", ...}], "tools": [...]}`, or
for plain text `{"text": "..."}`.  A row that cannot be trained on raises `Problem` with a reason
(counted per kind in the data report) and a detail that names the field.
"""

from __future__ import annotations

import json
from typing import Any

from trainer.core.errors import DataError
from trainer.data.sources import BadJson

COLUMNS = {  # format -> the columns that identify it, in detection order
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),  # `input` is optional
    "text": ("text",),
}
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
PASSED_THROUGH = ("tool_calls", "name", "tool_call_id", "reasoning_content")  # message keys kept besides role/content


class Problem(Exception):
    """Why one row cannot be trained on: `reason` is the kind (counted), `detail` names the field."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def detect(columns: list[str], setting: str, source: str) -> str:
    """The format FT_DATA_FORMAT names, or the first one whose columns the data has."""
    if setting != "auto":
        missing = [c for c in COLUMNS[setting] if c not in columns]
        if missing and columns:
            raise DataError(
                f"FT_DATA_FORMAT={setting} needs the column(s) {missing}, but {source} has columns {columns}; rename them or set FT_DATA_FORMAT=auto"
            )
        return setting
    for name, needed in COLUMNS.items():
        if all(c in columns for c in needed):
            return name
    raise DataError(
        f"{source}: unknown format: its columns {columns} match none of 'messages' (role/content), 'conversations' "
        "(ShareGPT from/value), 'prompt' + 'completion', 'instruction' + 'output' (Alpaca), or 'text'; "
        'convert each row to {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]} '
        "(docs/data.md#row-formats-ft_data_format shows how)"
    )


def convert(row: Any, fmt: str, control_tokens: tuple[str, ...] = ()) -> dict:
    """Check one row and return its internal form; raise Problem when it cannot be trained on."""
    if isinstance(row, BadJson):
        length = f"; the line has {row.length} characters" if row.length is not None else ""
        raise Problem("not valid JSON", f"not valid JSON ({row.message}: column {row.column}{length})")
    if row is None:
        raise Problem("null row", "the row is null")
    if not isinstance(row, dict):
        raise Problem("row not an object", f"the row is {_kind(row)}, not an object with columns")
    if fmt == "text":
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise Problem(
                "empty text" if isinstance(text, str) or text is None else "content not a string", f"text is {_kind(text)}; expected a non-empty string"
            )
        _no_control_tokens(text, "text", control_tokens)
        return {"text": text}
    if fmt == "prompt_completion":
        messages = _prompt_completion(row.get("prompt"), row.get("completion"))
        field = "prompt/completion"
    elif fmt == "alpaca":
        messages, field = _alpaca(row.get("instruction"), row.get("input"), row.get("output"), row.get("system")), "instruction/input/output"
    elif fmt == "sharegpt":
        messages, field = _sharegpt(_parsed(row.get("conversations"), "conversations")), "conversations"
    else:
        messages, field = _parsed(row.get("messages"), "messages"), "messages"
    converted = {"messages": _conversation(messages, field, control_tokens)}
    tools = _parsed(row.get("tools"), "tools") if row.get("tools") is not None else None
    if tools is not None:
        if not isinstance(tools, list):
            raise Problem("bad tools", f"tools is {_kind(tools)}; expected a list of function schemas")
        converted["tools"] = tools
    return converted


def _parsed(value: Any, field: str) -> Any:
    """Lists stored as JSON strings (the usual way to put conversations in a CSV column) are decoded."""
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise Problem("not valid JSON", f"{field} is a string that is not valid JSON ({error.msg})") from error
    return value


def _prompt_completion(prompt: Any, completion: Any) -> list:
    """Strings become one user and one assistant turn; conversational prompt/completion lists are joined."""
    prompt, completion = _parsed(prompt, "prompt"), _parsed(completion, "completion")
    if prompt is None or completion is None:
        raise Problem("missing field", f"{'prompt' if prompt is None else 'completion'} is missing or null")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list):
        return prompt + completion
    raise Problem("content not a string", f"prompt is {_kind(prompt)} and completion is {_kind(completion)}; expected two strings or two lists of messages")


def _alpaca(instruction: Any, extra: Any, output: Any, system: Any) -> list:
    """Alpaca's row as one exchange: the instruction, then its input after a blank line (as Alpaca's own prompt
    separates them), as the user turn; the output as the reply; a `system` column, where present, first."""
    for name, value in (("instruction", instruction), ("output", output)):
        if value is None:
            raise Problem("missing field", f"{name} is missing or null")
        if not isinstance(value, str):
            raise Problem("content not a string", f"{name} is {_kind(value)}, not a string")
    if extra is not None and not isinstance(extra, str):
        raise Problem("content not a string", f"input is {_kind(extra)}, not a string")
    user = instruction + (f"\n\n{extra}" if extra and extra.strip() else "")
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
    return [*head, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _sharegpt(turns: Any) -> Any:
    if not isinstance(turns, list):
        return turns  # reported by _conversation
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" in turn:
            out.append(turn)
            continue
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise Problem("unknown role", f"conversations[{i}].from is {speaker!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
        out.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")} | {k: turn[k] for k in PASSED_THROUGH if k in turn})
    return out


def _conversation(messages: Any, field: str, control_tokens: tuple[str, ...]) -> list[dict]:
    if messages is None:
        raise Problem("missing field", f"{field} is missing or null")
    if not isinstance(messages, list):
        raise Problem("not a list", f"{field} is {_kind(messages)}, not a list of messages")
    if not messages:
        raise Problem("empty conversation", f"{field} is an empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise Problem("message not an object", f"{where} is {_kind(message)}, not an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise Problem("unknown role", f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise Problem("content not a string", f"{where}.content is {_kind(content)}, not a string")
        if role == "assistant" and not content.strip() and not calls:
            raise Problem("empty assistant turn", f"{where} is an assistant turn with empty content")
        _no_control_tokens(content, f"{where}.content", control_tokens)
        weight = _weight(message, role, where)
        out.append({"role": role, "content": content} | {k: message[k] for k in PASSED_THROUGH if message.get(k) is not None} | weight)
    _check_order(out, field)
    return out


def _weight(message: dict, role: str, where: str) -> dict:
    """OpenAI's fine-tuning `weight`: 0 on an assistant turn keeps it as context, without loss (trainer/data/masking.py); 1 trains it."""
    if "weight" not in message:
        return {}
    weight = message["weight"]
    if role != "assistant" or isinstance(weight, bool) or weight not in (0, 1):
        raise Problem("bad weight", f"{where}.weight is {weight!r} ({role} turn); expected 0 (not trained) or 1, on assistant turns only")
    return {"weight": int(weight)}


def _check_order(messages: list[dict], field: str) -> None:
    """System first (optional), then a user turn; user and assistant alternate; tool results follow a tool call."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise Problem("no assistant turn", f"{field} has no assistant turn to train on")
    for i, role in enumerate(roles):
        previous = roles[i - 1] if i else None
        if role == "system" and i:
            raise Problem("bad order", f"{field}[{i}] is a system message after the first turn")
        if role != "system" and previous in (None, "system") and role != "user":
            raise Problem("bad order", f"{field}[{i}] has role {role}, but a conversation starts with a user turn (after an optional system message)")
        if role == previous and role in ("user", "assistant"):
            raise Problem("bad order", f"{field}[{i}] is a second {role} turn in a row")
        if role == "tool" and not (previous == "tool" or (previous == "assistant" and messages[i - 1].get("tool_calls"))):
            raise Problem("bad order", f"{field}[{i}] is a tool result that follows no tool call")
    if roles[-1] != "assistant":
        raise Problem("bad order", f"{field} ends with a {roles[-1]} turn that has no assistant reply")


def _no_control_tokens(text: str, where: str, control_tokens: tuple[str, ...]) -> None:
    for token in control_tokens:
        if token in text:
            raise Problem("control token in content", f"{where} contains the tokenizer's control token {token!r}, which would be read as markup")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "a string", int: "a number", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)
