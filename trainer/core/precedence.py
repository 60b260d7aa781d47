"""Which value each `FT_*` variable takes, highest first:

  1. an explicit `FT_*` variable;
  2. what the detected platform provides (SageMaker, Vertex AI, AWS Batch; see `platforms.py`) and the
     cluster's node wiring (`cluster.py`);
  3. the preset's defaults (`FT_PRESET=demo`);
  4. the field's default (the reference recipe).

`layered` builds that one mapping and `reader` parses it with environs, so parsing neither changes nor depends
on the process environment.  settings.py's `load` is the one caller.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from trainer.core import cluster, platforms
from trainer.core.volume import Volume

PREFIX = "FT_"


def preset_defaults(preset: str, output_dir: str) -> dict[str, str]:
    """Defaults a preset changes; explicit variables still override them."""
    if preset != "demo":
        return {}
    demo = Volume(output_dir).demo
    return {
        "FT_MODEL": os.path.join(demo, "model"),
        "FT_DATASET": os.path.join(demo, "data", "train.jsonl"),
        "FT_MAX_STEPS": "40",
        "FT_LEARNING_RATE": "1e-3",
        "FT_WARMUP_STEPS": "4",
        "FT_BATCH_SIZE": "4",
        "FT_GRADIENT_ACCUMULATION_STEPS": "2",
        "FT_EVAL_STEPS": "20",
        "FT_SAVE_STEPS": "20",
        "FT_LOGGING_STEPS": "5",
        "FT_EVAL_BATCH_SIZE": "16",
        "FT_MAX_LENGTH": "256",
        "FT_REGISTERED_MODEL": "demo.default.tiny_qwen3_assistant",
        "FT_EVAL_SAMPLE_TOKENS": "16",  # the longest demo answer is 13 tokens with its end-of-turn token
    }


def layered(environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The detected platform's name, and every value in order of precedence (later wins)."""
    platform, platform_env = platforms.detect(environ)  # honours FT_PLATFORM itself
    _, cluster_env = cluster.detect(environ)
    values = {**platform_env, **cluster_env, **environ}
    preset = values.get("FT_PRESET", "none")
    output_dir = values.get("FT_OUTPUT_DIR", "/output")
    # the platform mounted the user's data: it wins over the preset
    return platform, {**preset_defaults(preset, output_dir), **platform_env, **cluster_env, **environ}


def reader(values: Mapping[str, str]) -> Any:
    """An environs `Env(prefix="FT_", eager=False)` that reads `values` instead of `os.environ`."""
    from environs import Env

    class LayeredEnv(Env):
        """environs reads `os.environ`; this reads the layered values (preset < platform < explicit) instead,
        so parsing neither changes nor depends on the process environment.

        `_get_value` is private (environs 15.2.0: `os.environ[key]`, then `self._environ`), and environs has no
        public way to parse a mapping; the alternative, writing the values into `os.environ` for the parse, would
        change the process environment.  Remove this once `Env` accepts a mapping (tests/test_settings.py fails
        loudly if the method is renamed: no FT_* value would be read)."""

        def _get_value(self, env_key: str, default: Any) -> Any:
            return values.get(env_key, default)

    return LayeredEnv(prefix=PREFIX, eager=False)
