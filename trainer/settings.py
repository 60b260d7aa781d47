"""The job's whole configuration: one table of `FT_*` environment variables.

The table is the single source for parsing, validation, the README's table of variables and the
parameters logged to MLflow.  Every variable is read, then all errors are reported together
(environs' `eager=False` + `seal()`), before anything heavy is imported.

Precedence, highest first:
  1. an explicit `FT_*` variable;
  2. what the detected platform provides (SageMaker, Vertex AI, AWS Batch; see `platforms.py`);
  3. the preset's defaults (`FT_PRESET=demo`);
  4. the default in the table (the reference recipe).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from trainer.errors import ConfigError

PREFIX = "FT_"
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|CREDENTIAL|API_KEY|ACCESS_KEY|CONNECTION_STRING", re.I)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # without the FT_ prefix
    kind: type | tuple[str, ...]  # int, float, bool, str, or the allowed values
    default: Any
    help: str
    group: str
    minimum: float | None = None  # inclusive lower bound for numbers
    secret: bool = False

    @property
    def env_name(self) -> str:
        return PREFIX + self.name

    @property
    def allowed(self) -> str:
        """What a valid value looks like, for error messages."""
        if isinstance(self.kind, tuple):
            return "one of " + ", ".join(self.kind)
        floor = f" >= {self.minimum:g}" if self.minimum is not None else ""
        return {int: f"an integer{floor}", float: f"a number{floor}, e.g. {self.default}", bool: "true or false", str: "text"}[self.kind]

    @property
    def type_name(self) -> str:
        if isinstance(self.kind, tuple):
            return " \\| ".join(f"`{c}`" for c in self.kind)
        return self.kind.__name__


S = Setting
TABLE: tuple[Setting, ...] = (
    # -- What to train -------------------------------------------------------------------------
    S("PRESET", ("none", "demo"), "none", "`demo` builds a tiny Qwen3 model, tokenizer and chat dataset under `FT_OUTPUT_DIR/demo` (offline, deterministic) and trains on them; any explicit `FT_*` still wins.", "What to train"),
    S("MODEL", str, "Qwen/Qwen3-4B", "Base model: a Hugging Face hub id or a local folder with `config.json`.", "What to train"),
    S("MODEL_REVISION", str, "", "Hub revision (branch, tag or commit) to pin; empty = the default branch.", "What to train"),
    S("TRUST_REMOTE_CODE", bool, False, "Run Python code shipped with the model or dataset. Off: only architectures built into transformers load.", "What to train"),
    S("DATASET", str, "trl-lib/Capybara", "Training data: a hub id, a `save_to_disk` folder, local `.jsonl`/`.json`/`.parquet`/`.csv` files, a folder or glob of them, or an `s3://`/`gs://`/`az://` URL.", "What to train"),
    S("DATASET_CONFIG", str, "", "Hub dataset configuration name; empty = the default one.", "What to train"),
    S("DATASET_SPLIT", str, "train", "Split to train on.", "What to train"),
    S("DATASET_REVISION", str, "", "Hub dataset revision to pin; empty = the default branch.", "What to train"),
    S("EVAL_DATASET", str, "", "Validation data (same forms as `FT_DATASET`; from a dataset with several splits, `validation`, else `test`). Empty: `FT_DATASET`'s own `test` split when it has one (as the reference recipe; Capybara's 200 rows), else `FT_EVAL_FRACTION` of the training rows.", "What to train"),
    S("EVAL_FRACTION", float, 0.1, "Share of the checked training rows held out for validation when `FT_EVAL_DATASET` is empty and `FT_DATASET` has no `test` split (seed `FT_SEED`, as the reference recipe); 0 = no validation.", "What to train", minimum=0.0),
    S("DATA_FORMAT", ("auto", "messages", "sharegpt", "prompt_completion", "text"), "auto", "Row format (see the README's \"Your data\"): `messages` (role/content), `sharegpt` (`conversations` of from/value), `prompt_completion`, or `text`; `auto` detects it from the columns.", "What to train"),
    S("BAD_ROWS", ("fail", "skip"), "fail", "Rows that cannot be trained on (unknown role, empty reply, bad JSON, ...): `fail` exits 2 listing them with their reasons; `skip` leaves them out (counted per reason, logged to MLflow). Either way they are listed in `FT_OUTPUT_DIR/data-report.txt`.", "What to train"),
    S("LOSS_ON", ("all", "assistant"), "all", "Tokens that carry loss: `all` (the reference recipe) or `assistant`: only the assistant's replies and their end-of-turn token (works with Qwen3's stock template; other templates need `{% generation %}` markers).", "What to train"),
    S("MAX_LENGTH", int, 4096, "Longest training sequence in tokens. 4096 keeps Qwen3-4B within an 80 GB H100 with activation checkpointing.", "What to train", minimum=16),
    S("TRUNCATION", ("truncate", "drop"), "truncate", "Rows longer than `FT_MAX_LENGTH`: cut at the limit, or leave out (both counted).", "What to train"),
    S("DATA_CACHE", bool, True, "Keep the checked, tokenized data under `FT_OUTPUT_DIR/.fulltune/data-cache/`, keyed by data source, tokenizer and data settings, so a restart skips checking and tokenizing.", "What to train"),
    # -- Optimisation --------------------------------------------------------------------------
    S("MAX_STEPS", int, 50, "Optimizer steps to train.", "Optimisation", minimum=1),
    S("LEARNING_RATE", float, 2e-5, "Peak learning rate of AdamW.", "Optimisation", minimum=0.0),
    S("LR_SCHEDULER", ("linear", "cosine", "constant_with_warmup"), "linear", "Learning-rate schedule after warm-up.", "Optimisation"),
    S("WARMUP_STEPS", int, 10, "Linear warm-up steps.", "Optimisation", minimum=0),
    S("WEIGHT_DECAY", float, 0.01, "AdamW weight decay.", "Optimisation", minimum=0.0),
    S("MAX_GRAD_NORM", float, 1.0, "Gradient clipping norm; 0 = no clipping.", "Optimisation", minimum=0.0),
    S("BATCH_SIZE", int, 1, "Sequences per forward pass as the recipe states it; with `FT_BATCH_LAYOUT=auto` only the product with `FT_GRADIENT_ACCUMULATION_STEPS` (sequences per optimizer step) is kept, and the passes are regrouped to fill the device.", "Optimisation", minimum=1),
    S("GRADIENT_ACCUMULATION_STEPS", int, 8, "Forward passes per optimizer step; effective batch = batch size × this.", "Optimisation", minimum=1),
    S("SEED", int, 42, "Seed for the split, the data order and initialisation.", "Optimisation", minimum=0),
    # -- Evaluation and checkpoints ------------------------------------------------------------
    S("EVAL_STEPS", int, 25, "Evaluate every N optimizer steps.", "Evaluation and checkpoints", minimum=1),
    S("EVAL_BATCH_SIZE", int, 1, "Sequences per evaluation forward pass.", "Evaluation and checkpoints", minimum=1),
    S("SAVE_STEPS", int, 25, "Commit a checkpoint every N optimizer steps. Must be a multiple of `FT_EVAL_STEPS` (the best model is chosen by eval loss at save time).", "Evaluation and checkpoints", minimum=1),
    S("SAVE_TOTAL_LIMIT", int, 2, "Committed checkpoints to keep (the best one is kept as well).", "Evaluation and checkpoints", minimum=1),
    S("LOGGING_STEPS", int, 10, "Log loss, learning rate and throughput every N optimizer steps.", "Evaluation and checkpoints", minimum=1),
    S("OUTPUT_DIR", str, "/output", "The mounted volume: checkpoints, the final model, the MLflow store when no server is set.", "Evaluation and checkpoints"),
    # -- Hardware ------------------------------------------------------------------------------
    S("PRECISION", ("auto", "fp32", "bf16-mixed", "bf16-sr"), "auto", "`bf16-mixed`: fp32 master weights and optimizer, bf16 compute (no update is lost). `auto`: bf16-mixed on a bf16-capable GPU, fp32 on CPU (bf16 on CPU is 7-25x slower). `bf16-sr` (opt-in until measured on GPU): bf16 weights and gradients, fp32 AdamW states, each update written back to the weights with stochastic rounding (trainer/optim.py; `FT_OPTIMIZER` does not apply): 12 B/param instead of 16 (48 GB instead of 64 for Qwen3-4B) and 10 B/param checkpoints instead of 12; on the demo model at lr 2e-5 it applies 100 % of the fp32 run's update in expectation where round-to-nearest applies 27 %, and its losses are within 0.1 % of fp32 (bench/RESULTS.md). Allowed on CPU, slowly.", "Hardware"),
    S("ACTIVATION_CHECKPOINTING", ("auto", "full", "selective", "off"), "auto", "Recompute activations in the backward pass instead of keeping them (non-reentrant; transformers' `every_n_layers`). `full`: every decoder layer; `selective`: only every n-th layer, n as large as the memory plan (trainer/memory.py) fits (every 2nd without a device limit); `auto`: the least recomputation that fits: none, selective, or full; never on CPU.", "Hardware"),
    # -- Throughput ----------------------------------------------------------------------------
    S("BATCH_LAYOUT", ("auto", "as-set"), "auto", "`auto`: each optimizer step still trains on `FT_BATCH_SIZE` × `FT_GRADIENT_ACCUMULATION_STEPS` sequences in the same order (same loss, same updates), but in as few forward passes as the memory plan fits (one on CPU). `as-set`: exactly `FT_BATCH_SIZE` sequences per pass, as TRL does.", "Throughput"),
    S("PADDING_FREE", ("auto", "on", "off"), "auto", "Concatenate the sequences of a forward pass into one row without padding (TRL `padding_free`; each sequence still attends only to itself, through `position_ids`). `auto`: on (measured 2.3x the padded tokens/s on CPU, bench/RESULTS.md); attention runs per sequence (trainer/attention.py) unless the model uses FlashAttention.", "Throughput"),
    S("OPTIMIZER", ("auto", "adamw_torch", "adamw_torch_fused"), "auto", "AdamW implementation; the update is the same. `auto`: the fused kernel (one launch for all parameters) on GPU, the loop on CPU.", "Throughput"),
    S("COMPILE", bool, False, "`torch.compile` the model. Off until measured on the target GPU: the first steps compile for minutes.", "Throughput"),
    S("LIGER", bool, False, "Liger Triton kernels for RMSNorm, SwiGLU and RoPE (needs the `liger-kernel` package and a GPU). The loss never materialises the full logits either way: TRL computes it in chunks.", "Throughput"),
    S("EVAL_MAX_SAMPLES", int, 0, "Evaluate on at most this many validation rows (the first ones of the split, always the same); 0 = all of them.", "Throughput", minimum=0),
    S("DATALOADER_WORKERS", int, 0, "Background processes that collate batches; 0 = in the training process. Rows are tokenized up front, so a step's batch takes ~3 ms to build in-process and ~5.5 ms to receive from 2 workers (bench/dataloader.py), against ~0.55 s for a Qwen3-4B step.", "Throughput", minimum=0),
    S("PREFLIGHT", ("fail", "warn", "off"), "fail", "Before loading weights: estimate peak GPU memory from the model config and check the volume has room for the checkpoints. `fail`: exit 2 with the breakdown and the settings that would fit; `warn`: print it and go on.", "Throughput"),
    S("GPU_MEMORY_GB", float, 0.0, "GPU memory the plan must fit, in GB; 0 = what the device reports. Set it to plan for a smaller card than the one at hand.", "Throughput", minimum=0.0),
    # -- Tracking and registry -----------------------------------------------------------------
    S("REGISTERED_MODEL", str, "main.default.qwen3_4b_assistant", "MLflow registered model name (`catalog.schema.model` on Unity Catalog); empty = do not register.", "Tracking and registry"),
    S("RUN_NAME", str, "", "MLflow run name; empty = `<model>_full-fine-tuning`.", "Tracking and registry"),
    S("SYSTEM_METRICS", bool, True, "Log CPU/GPU/memory system metrics to the MLflow run.", "Tracking and registry"),
    # -- Operations ----------------------------------------------------------------------------
    S("PLATFORM", ("auto", "none", "sagemaker", "vertex", "aws-batch", "azureml"), "auto", "Batch platform whose variables fill in unset `FT_*` settings; `auto` detects it, `none` ignores them.", "Operations"),
    S("STOP_DEADLINE_SECONDS", int, 270, "After SIGTERM/SIGINT the job finishes the current optimizer step and commits a checkpoint; past this many seconds it gives up (exit 76). Keep it below the platform's grace period (the Kubernetes Job: 300 s; on SageMaker, which allows 120 s, it defaults to 100).", "Operations", minimum=1),
    S("ALLOW_CONFIG_CHANGE", bool, False, "Resume checkpoints on the volume even though model, data or hyperparameters changed since they were written.", "Operations"),
    S("TERMINATION_MESSAGE_PATH", str, "/dev/termination-log", "File that receives a one-line reason on every non-zero exit (read by Kubernetes); empty = none.", "Operations"),
)
del S

BY_ENV_NAME = {s.env_name: s for s in TABLE}
Settings = dataclasses.make_dataclass(
    "Settings", [(s.name.lower(), Any) for s in TABLE] + [("detected_platform", str, "none")], frozen=True
)
Settings.__doc__ = "The effective configuration of one job, parsed and validated from the environment."


def preset_defaults(preset: str, output_dir: str) -> dict[str, str]:
    """Defaults a preset changes; explicit variables still override them."""
    if preset != "demo":
        return {}
    demo = os.path.join(output_dir, "demo")
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
    }


def load(environ: Mapping[str, str] | None = None) -> Any:
    """Parse and validate every `FT_*` variable; raise one ConfigError listing all problems."""
    from environs import Env, EnvValidationError
    from marshmallow.validate import OneOf, Range

    from trainer import platforms

    environ = dict(os.environ if environ is None else environ)
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in BY_ENV_NAME)
    platform, platform_env = platforms.detect(environ)  # honours FT_PLATFORM itself
    layered = {**platform_env, **environ}
    preset = layered.get("FT_PRESET", "none")
    output_dir = layered.get("FT_OUTPUT_DIR", "/output")
    layered = {**platform_env, **preset_defaults(preset, output_dir), **environ}

    env = Env(prefix=PREFIX, eager=False)
    saved = {k: os.environ.get(k) for k in layered if k.startswith(PREFIX)}
    os.environ.update({k: v for k, v in layered.items() if k.startswith(PREFIX)})
    try:
        values = {}
        for s in TABLE:
            if isinstance(s.kind, tuple):
                values[s.name] = env.str(s.name, s.default, validate=OneOf(s.kind, error="not a valid choice"))
            else:
                validate = Range(min=s.minimum, error="out of range") if s.minimum is not None else None
                parse = {int: env.int, float: env.float, bool: env.bool, str: env.str}[s.kind]
                values[s.name] = parse(s.name, s.default, validate=validate)
        problems: dict[str, str] = {}
        try:
            env.seal()
        except EnvValidationError as error:
            for name, messages in error.error_messages.items():
                problems[name] = "; ".join(str(m).rstrip(".") for m in messages) + f" (allowed: {BY_ENV_NAME[name].allowed})"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    for name in unknown:
        problems[name] = "is not a fulltune setting (see the README's table of variables)"
    if not problems:
        problems.update(_cross_checks(values))
    if problems:
        lines = [f"  {name}={_shown(name, layered.get(name))!s}: {why}" for name, why in sorted(problems.items())]
        raise ConfigError(f"{len(problems)} invalid setting(s):\n" + "\n".join(lines))
    return Settings(**{k.lower(): v for k, v in values.items()}, detected_platform=platform)


def _cross_checks(values: dict[str, Any]) -> dict[str, str]:
    """Rules that involve two settings; each names the variable to change."""
    problems = {}
    if values["SAVE_STEPS"] % values["EVAL_STEPS"]:
        problems["FT_SAVE_STEPS"] = f"must be a multiple of FT_EVAL_STEPS={values['EVAL_STEPS']} so every checkpoint has an eval loss for picking the best model"
    if not 0.0 <= values["EVAL_FRACTION"] < 1.0:
        problems["FT_EVAL_FRACTION"] = "must be >= 0 and < 1"
    if not values["OUTPUT_DIR"].strip():
        problems["FT_OUTPUT_DIR"] = "must name a folder (the mounted volume)"
    if not values["MODEL"].strip():
        problems["FT_MODEL"] = "must name a hub id or a local folder"
    if not values["DATASET"].strip():
        problems["FT_DATASET"] = "must name a hub id, a folder or files"
    name = values["REGISTERED_MODEL"]
    if name and not re.fullmatch(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+){0,2}", name):
        problems["FT_REGISTERED_MODEL"] = "must be `model` or `catalog.schema.model` (letters, digits, _ and -)"
    return problems


def _shown(name: str, value: str | None) -> str:
    if value is None:
        return "<unset>"
    setting = BY_ENV_NAME.get(name)
    if (setting and setting.secret) or SECRET_NAME.search(name):
        return "****"
    return repr(value)


def as_params(settings: Any) -> dict[str, str]:
    """The effective configuration as MLflow params: every FT_* value (secrets masked), nothing else."""
    params = {}
    for s in TABLE:
        value = getattr(settings, s.name.lower())
        params[s.env_name] = "****" if s.secret else str(value)
    params["detected_platform"] = settings.detected_platform
    return params


def readme_table() -> str:
    """The README's table of variables, generated from TABLE (a test keeps them in sync)."""
    out, group = [], None
    for s in TABLE:
        if s.group != group:
            group = s.group
            out += ["", f"**{group}**", "", "| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
        default = "*(empty)*" if s.default == "" else f"`{s.default}`"
        out.append(f"| `{s.env_name}` | {s.type_name} | {default} | {s.help} |")
    return "\n".join(out).strip() + "\n"


def update_readme(path: str = "README.md") -> None:
    """Rewrite the README's generated tables: `python -m trainer.settings`."""
    from trainer.errors import EXIT_CODES

    with open(path, encoding="utf-8") as f:
        text = f.read()
    codes = "| Code | Meaning |\n|---|---|\n" + "".join(f"| {code} | {meaning} |\n" for code, meaning in EXIT_CODES.items())
    for marker, body in (("settings", readme_table()), ("exit-codes", codes)):
        start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
        head, rest = text.split(start)
        text = head + start + body + end + rest.split(end, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    update_readme()
