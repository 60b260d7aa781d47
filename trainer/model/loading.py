"""Tokenizer and model: loading, chat template, padding, and what the model is (family, size)."""

from __future__ import annotations

import json
from typing import Any

from trainer.core import locations
from trainer.core.config import Precision
from trainer.core.errors import ConfigError
from trainer.core.settings import Settings
from trainer.data import chatml


def hub_kwargs(settings: Settings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": settings.trust_remote_code}
    if settings.model_revision:
        kwargs["revision"] = settings.model_revision
    return kwargs


def read_config(settings: Settings) -> Any:
    """The model's config alone (a few KB): enough to plan memory before downloading weights."""
    from huggingface_hub import constants
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(settings.model, **hub_kwargs(settings))
    except (OSError, ValueError) as error:
        if not locations.is_hub_id(settings.model):
            raise ConfigError(f"FT_MODEL={settings.model!r}: cannot read a model config there ({error})") from error
        if constants.HF_HUB_OFFLINE:  # nothing a retry changes: the cache lacks it
            raise ConfigError(
                f"FT_MODEL={settings.model!r}: HF_HUB_OFFLINE=1 and the hub cache (HF_HOME) does not hold it; {locations.not_local(settings.model)}."
                " Point FT_MODEL at a local folder with config.json, or fill the cache on a connected machine"
            ) from error
        raise


def load_tokenizer(settings: Settings) -> Any:
    """Load the tokenizer; add ChatML only when it has no chat template; pad = EOS when missing."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model, **hub_kwargs(settings))
    if settings.chat_template:  # FT_CHAT_TEMPLATE: renders every row, and is saved with the model
        tokenizer.chat_template = chat_template(settings.chat_template)
    if not tokenizer.chat_template:
        tokenizer.add_special_tokens({"additional_special_tokens": [chatml.IM_START, chatml.IM_END]})
        tokenizer.chat_template = chatml.TEMPLATE
        tokenizer.eos_token = chatml.IM_END
        print("fulltune: the tokenizer has no chat template: added ChatML", flush=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def chat_template(path: str) -> str:
    """The Jinja template in FT_CHAT_TEMPLATE's file; exit 2 for a file that is not UTF-8 text or not a template Jinja can compile."""
    import jinja2

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        jinja2.Environment().parse(text)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"FT_CHAT_TEMPLATE={path!r}: cannot be read as UTF-8 text ({error})") from None
    except jinja2.TemplateSyntaxError as error:
        raise ConfigError(f"FT_CHAT_TEMPLATE={path!r}: not a Jinja template: line {error.lineno}: {error.message}") from None
    if not text.strip():
        raise ConfigError(f"FT_CHAT_TEMPLATE={path!r}: the file is empty; it must hold a Jinja chat template")
    return text


def load_model(settings: Settings, tokenizer: Any, precision: Precision, dtype: Any = None) -> Any:
    """Load the weights in the precision's weight dtype (fp32 master weights, or bf16 with FT_PRECISION=bf16-sr;
    see trainer/core/config.py), or `dtype` (the evaluation's serving precision), and fit the embeddings to the tokenizer."""
    from transformers import AutoModelForCausalLM

    # safetensors only, unless FT_ALLOW_PICKLE_WEIGHTS (trainer/model/trust.py checked the files in the preflight)
    use_safetensors = None if settings.allow_pickle_weights else True
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=dtype or precision.dtype(), use_safetensors=use_safetensors, **hub_kwargs(settings))
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # ChatML tokens were added
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        if model.generation_config.eos_token_id is None:
            model.generation_config.eos_token_id = eos
    return model


def parameter_count(config: Any, trust_remote_code: bool = False) -> int:
    """Parameters of a causal LM from its config alone (used for metadata and the memory plan).  `trust_remote_code`:
    FT_TRUST_REMOTE_CODE, for a config whose model class is the model's own code (without it transformers asks on stdin)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def describe_size(n_params: int) -> str:
    """`4b`, `0.6b`, `7m`: the seed's databricks_model_size_parameters style."""
    if n_params >= 1e9:
        return f"{n_params / 1e9:.1f}".rstrip("0").rstrip(".") + "b"
    return f"{max(n_params / 1e6, 0.1):.1f}".rstrip("0").rstrip(".") + "m"


def model_family(config: Any) -> str:
    architectures = getattr(config, "architectures", None) or []
    return architectures[0] if architectures else json.dumps(config.model_type)
