"""Which value each `FT_*` variable takes, highest first:

  1. an explicit `FT_*` variable;
  2. what the detected platform provides (SageMaker, Vertex AI, AWS Batch; see `platforms.py`) and the
     cluster's node wiring (`cluster.py`);
  3. the preset's defaults (`FT_PRESET=demo`);
  4. the field's default (the reference recipe).

`layers` and `layered` build that one mapping and `reader` parses it with environs, so parsing neither changes nor depends
on the process environment; `losers` says which of two settings that say the same thing gives way (FT_NUM_EPOCHS
set explicitly wins over a preset's FT_MAX_STEPS; both explicit, FT_MAX_STEPS wins).  settings.py's `load` is the one caller.
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
    # Long enough to learn the task (trainer/data/demo.py) with steps to spare: at this batch and learning rate the
    # held-out answers turn right around step 100, on 1 or 2 threads and other seeds (bench/demo_learning.py and
    # bench/RESULTS.md; at 2e-3 the turn came anywhere from step 75 to 180); the loss on the answers alone
    # (FT_LOSS_ON=assistant) gets there in about half the steps the loss on every token takes.
    return {
        "FT_MODEL": os.path.join(demo, "model"),
        "FT_DATASET": os.path.join(demo, "data", "train.jsonl"),
        "FT_LOSS_ON": "assistant",
        "FT_MAX_STEPS": "240",
        "FT_LEARNING_RATE": "1e-3",
        "FT_WARMUP_RATIO": "0.1",
        "FT_BATCH_SIZE": "16",
        "FT_GRADIENT_ACCUMULATION_STEPS": "4",
        "FT_EVAL_STEPS": "20",
        "FT_SAVE_STEPS": "20",
        "FT_LOGGING_STEPS": "5",
        "FT_EVAL_BATCH_SIZE": "16",
        "FT_MAX_LENGTH": "256",
        "FT_REGISTERED_MODEL": "demo.default.tiny_qwen3_assistant",
        "FT_EVAL_SAMPLES": "8",
        "FT_EVAL_SAMPLE_TOKENS": "16",  # the longest demo answer is 13 tokens with its end-of-turn token
        # After training: the demo's own benchmark (held-out lists, written with the demo) and 24 of its validation rows
        "FT_EVAL_TASKS": os.path.join(demo, "eval-tasks"),
        "FT_EVAL_ROWS": "24",
        "FT_EVAL_MAX_NEW_TOKENS": "16",
    }


# Pairs where one setting says the same as the other in other units: the one set at a higher level of the list above
# wins, and the count of steps wins a tie (both explicit, as transformers' max_steps wins over num_train_epochs).
# settings.py's `load` records the loser as 0 (unused).
EITHER = (("FT_MAX_STEPS", "FT_NUM_EPOCHS"), ("FT_WARMUP_STEPS", "FT_WARMUP_RATIO"))


def layers(environ: Mapping[str, str]) -> tuple[str, list[dict[str, str]]]:
    """The detected platform's name, and the values of each level, lowest first: preset, platform, cluster, explicit."""
    platform, platform_env = platforms.detect(environ)  # honours FT_PLATFORM itself
    _, cluster_env = cluster.detect(environ)
    values = {**platform_env, **cluster_env, **environ}
    preset = values.get("FT_PRESET", "none")
    output_dir = values.get("FT_OUTPUT_DIR", "/output")
    # the platform mounted the user's data: it wins over the preset
    return platform, [preset_defaults(preset, output_dir), dict(platform_env), dict(cluster_env), dict(environ)]


def layered(levels: list[dict[str, str]]) -> dict[str, str]:
    """Every value, each from the highest level that sets it."""
    return {k: v for level in levels for k, v in level.items()}


def level(levels: list[dict[str, str]], name: str) -> int:
    """How high the value of `name` comes from: the index of the highest level that sets it, -1 for the field's default."""
    return max((i for i, values in enumerate(levels) if name in values), default=-1)


def losers(levels: list[dict[str, str]]) -> set[str]:
    """Of each pair in EITHER, the setting that gives way (its value is not used)."""
    return {other if level(levels, steps) >= level(levels, other) else steps for steps, other in EITHER}


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
