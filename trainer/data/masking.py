"""Which tokens carry loss: render each row with the chat template and mark the trained tokens.

FT_LOSS_ON=all trains every token, as the reference recipe does.  FT_LOSS_ON=assistant trains only
what the assistant says, found in one of three ways, first match wins:

1. the template has `{% generation %}` markers: transformers' assistant mask;
2. the template lays turns out as ChatML (`<|im_start|>role\\n ... <|im_end|>`), as Qwen2.5 and
   Qwen3 do: the rendered assistant blocks.  The stock template renders the text, so the model is
   trained on exactly what serving shows it.  For Qwen3 that matters: TRL 1.16 swaps in a patched
   template that writes and trains an empty `<think>\\n\\n</think>\\n\\n` in *every* assistant turn,
   while the stock template (the one served) keeps it only in the last turn.  We train on the
   stock rendering: history turns as served, and the last turn's empty think block is trained,
   which teaches a non-thinking chat fine-tune to answer directly;
3. TRL ships a training template for this model family: that template.

The assistant's end-of-turn token (`<|im_end|>` for ChatML, which is Qwen3's EOS) is trained so
that the model learns to stop; the newline after it and the `<|im_start|>assistant\\n` header are
not.  Plain-text rows are trained on every token, with EOS appended.
"""

from __future__ import annotations

from typing import Any

from trainer.core.errors import ConfigError
from trainer.data.chatml import IM_END, IM_START
from trainer.data.formats import Problem

PROBE = [  # renders distinct strings per role, to check that a template lays turns out as ChatML
    {"role": "system", "content": "probe-system"},
    {"role": "user", "content": "probe-user-1"},
    {"role": "assistant", "content": "probe-assistant-1"},
    {"role": "user", "content": "probe-user-2"},
    {"role": "assistant", "content": "probe-assistant-2"},
]


class Masker:
    """Turns internal rows into (input_ids, trained) pairs, where trained[i] says token i carries loss."""

    def __init__(self, tokenizer: Any, loss_on: str, fmt: str):
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        self.tokenizer, self.template = tokenizer, None
        self.control_tokens = tuple(t for t in tokenizer.all_special_tokens if t)
        self._tools: bool | None = None
        self._is_chatml: bool | None = None
        if fmt == "text":
            if loss_on == "assistant":
                raise ConfigError(
                    "FT_LOSS_ON=assistant needs conversations, but the data is plain text (FT_DATA_FORMAT=text): "
                    "set FT_LOSS_ON=all or provide messages, conversations or prompt/completion rows"
                )
            self.kind, self.method = "all", "all tokens of the text, EOS appended"
        elif loss_on == "all":
            self.kind, self.method = "all", "all tokens (chat template rendered)"
        elif has_generation_markers(tokenizer.chat_template or ""):
            self.kind, self.method = "markers", "assistant tokens ({% generation %} markers of the model's template)"
        elif _is_chatml(tokenizer):
            self.kind, self.method = "chatml", "assistant tokens (ChatML turns of the model's own template; <|im_end|> trained)"
        else:
            try:
                self.template = get_training_chat_template(tokenizer)
            except ValueError as error:
                raise ConfigError(
                    "FT_LOSS_ON=assistant: the chat template of FT_MODEL is not training-compatible: it has no {% generation %} "
                    "markers, is not ChatML, and TRL has no training template for it. Wrap the assistant reply in the template "
                    "with {% generation %}...{% endgeneration %} (docs/data.md#what-is-trained-ft_loss_on), or set FT_LOSS_ON=all"
                ) from error
            self.kind, self.method = "markers", "assistant tokens (TRL's training template for this model family)"

    def encode(self, rows: list[dict]) -> list[tuple[list[int], list[bool]] | Problem]:
        out: list[Any] = []
        texts: list[str | None] = []
        for row in rows:
            try:
                texts.append(self._render(row))
                out.append(None)
            except Problem as problem:
                texts.append(None)
                out.append(problem)
        if self.kind == "markers":
            return [p if p else self._marked(row) for p, row in zip(out, rows, strict=True)]
        batch = [t for t in texts if t is not None]
        encoded = self.tokenizer(batch, add_special_tokens=False, return_offsets_mapping=True) if batch else {"input_ids": [], "offset_mapping": []}
        pairs = iter(zip(encoded["input_ids"], encoded["offset_mapping"], strict=True))
        for i, text in enumerate(texts):
            if text is None:
                continue
            ids, offsets = next(pairs)
            weights = [m.get("weight", 1) for m in rows[i].get("messages", []) if m["role"] == "assistant"]
            if self.kind == "all" and all(weights):
                out[i] = (list(ids), [True] * len(ids))
                continue
            if self.kind == "all" and not self._chatml():
                out[i] = Problem("weight unsupported", 'has an assistant turn with "weight": 0, but the chat template '
                                                       'of FT_MODEL is not ChatML, so its turns cannot be told apart')
                continue
            spans = _assistant_spans(text)
            if len(spans) != len(weights):
                out[i] = Problem("template error", "the rendered conversation does not have one ChatML block per assistant turn")
                continue
            if self.kind == "all":  # every token but those of the assistant turns with weight 0
                untrained = [span for span, weight in zip(spans, weights, strict=True) if not weight]
                out[i] = (list(ids), [not any(a <= start < b for a, b in untrained) for start, _ in offsets])
                continue
            trained = [span for span, weight in zip(spans, weights, strict=True) if weight]
            out[i] = (list(ids), [any(a <= start < b for a, b in trained) for start, _ in offsets])
        return out

    def _render(self, row: dict) -> str:
        from jinja2 import TemplateError

        if "text" in row:
            eos = self.tokenizer.eos_token or ""
            prefix = self.tokenizer.bos_token if getattr(self.tokenizer, "add_bos_token", False) and self.tokenizer.bos_token else ""
            return prefix + row["text"] + ("" if row["text"].endswith(eos) else eos)
        if (row.get("tools") or any("tool_calls" in m for m in row["messages"])) and not self._supports_tools():
            raise Problem("tool calls unsupported", "has tool calls, but the chat template of FT_MODEL does not render them")
        try:
            text = self.tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False, chat_template=self.template)
        except (TemplateError, TypeError, ValueError) as error:
            raise Problem("template error", f"the chat template cannot render it ({type(error).__name__}: {error})") from error
        for i, message in enumerate(row["messages"]):
            if message["role"] in ("system", "user") and message["content"].strip() not in text:
                raise Problem("dropped by template", f"messages[{i}] ({message['role']}) is left out by the chat template of FT_MODEL")
        return text

    def _marked(self, row: dict) -> tuple[list[int], list[bool]] | Problem:
        from jinja2 import TemplateError

        if any(m.get("weight") == 0 for m in row["messages"]):  # transformers' assistant mask is one for all turns
            return Problem("weight unsupported", 'has an assistant turn with "weight": 0, which {% generation %} masking cannot leave out; '
                                                 'drop the turn or its weight')

        try:
            out = self.tokenizer.apply_chat_template(
                row["messages"], tools=row.get("tools"), chat_template=self.template, return_dict=True, return_assistant_tokens_mask=True
            )
        except (TemplateError, TypeError, ValueError) as error:
            return Problem("template error", f"the chat template cannot render it ({type(error).__name__}: {error})")
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]

    def _chatml(self) -> bool:
        if self._is_chatml is None:
            self._is_chatml = _is_chatml(self.tokenizer)
        return self._is_chatml

    def _supports_tools(self) -> bool:
        if self._tools is None:
            from trl.chat_template_utils import supports_tool_calling

            self._tools = supports_tool_calling(self.tokenizer)
        return self._tools


def _assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant blocks of a ChatML rendering: after the header, through <|im_end|>."""
    spans, start = [], text.find(IM_START)
    while start != -1:
        header_end = text.find("\n", start)
        end = text.find(IM_END, header_end)
        if header_end == -1 or end == -1:
            break
        if text[start + len(IM_START) : header_end] == "assistant":
            spans.append((header_end + 1, end + len(IM_END)))
        start = text.find(IM_START, end)
    return spans


def _is_chatml(tokenizer: Any) -> bool:
    vocab = tokenizer.get_vocab()
    if IM_START not in vocab or IM_END not in vocab:
        return False
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    except Exception:  # noqa: BLE001 - any template failure means "not ChatML"
        return False
    trained = "".join(text[a:b] for a, b in _assistant_spans(text))
    return all(f"probe-assistant-{i}" in trained for i in (1, 2)) and not any(s in trained for s in ("probe-user", "probe-system"))


def show(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    """One example as text, with the trained spans marked ⟦like this⟧."""
    out, run, trained = [], [], None
    for token, label in [*zip(ids, labels, strict=True), (None, None)]:
        now = label != -100 if token is not None else None
        if now != trained and run:
            piece = tokenizer.decode(run, skip_special_tokens=False)
            out.append(f"⟦{piece}⟧" if trained else piece)
            run = []
        trained = now
        if token is not None:
            run.append(token)
    return "".join(out)
