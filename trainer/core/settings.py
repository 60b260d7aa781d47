"""The job's settings: one typed, frozen dataclass of `FT_*` environment variables.

`Settings` is the single source for parsing, validation, the table of variables (docs/settings.md, written
by settings_doc.py), the parameters logged to MLflow, and which settings change the result (the data cache
key and the resume fingerprint are both derived from `changes`).  Every variable is read, then all errors
are reported together (environs' `eager=False` + `seal()`), before anything heavy is imported.  `load` runs
once per job, in entrypoint.py; the training process receives the result (trainer/core/config.py), never
the environment.

Which value wins (explicit, platform, preset, default) is precedence.py's; the words of a refusal are refusals.py's;
`setting()`, which declares each field, and the table's rows made of the fields are fields.py's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

from trainer.core import refusals
from trainer.core.errors import ConfigError
from trainer.core.fields import rows, setting
from trainer.core.precedence import PREFIX


@dataclasses.dataclass(frozen=True)
class Settings:
    """The effective `FT_*` configuration of one job, parsed and validated from the environment."""

    # -- What to train -------------------------------------------------------------------------------
    preset: Literal["none", "demo"] = setting("none", "`demo` builds a tiny Qwen3 model, tokenizer and chat dataset under `FT_OUTPUT_DIR/demo` (offline, "
                                                      "deterministic) and trains on them; any explicit `FT_*` still wins.", group="What to train")
    model: str = setting("Qwen/Qwen3-4B", "Base model: a Hugging Face hub id or a local folder with `config.json`.", changes="data")
    model_revision: str = setting("", "Hub revision (branch, tag or commit) to pin; empty = the default branch.", changes="data")
    trust_remote_code: bool = setting(False, "Run Python code shipped with the model or dataset. Off: only architectures built into transformers load, and a "
                                             "model whose `model_type` needs its own code (`auto_map`) exits 2 before anything but its config is downloaded.")
    allow_pickle_weights: bool = setting(False, "Load a model whose weights exist only as pickle files (`*.bin`, `*.pt`), which "
                                                "can run code when unpickled. Off: weights load from safetensors only, and a "
                                                "model without them exits 2 naming its pickle files, before any weight is read.")
    dataset: str = setting("trl-lib/Capybara", "Training data: a hub id, a `save_to_disk` folder, local `.jsonl`/`.json`/`.parquet`/`.csv` "
                                               "files, a folder or glob of them, or an `s3://`/`gs://`/`az://` URL.", changes="data")
    dataset_config: str = setting("", "Hub dataset configuration name; empty = the default one.", changes="data")
    dataset_split: str = setting("train", "Split to train on.", changes="data")
    dataset_revision: str = setting("", "Hub dataset revision to pin; empty = the default branch.", changes="data")
    eval_dataset: str = setting("", "Validation data, in the same forms as `FT_DATASET` (from a dataset with several splits, `validation`, else `test`). "
                                    "Empty: `FT_DATASET`'s own `test` split when it has one, else `FT_EVAL_FRACTION` of the training rows.", changes="data")
    eval_fraction: float = setting(0.1, "Share of the checked training rows held out for validation (seed `FT_SEED`) when there "
                                        "is no `FT_EVAL_DATASET` and no `test` split; 0 = no validation, and the final model is "
                                        "the last step's rather than the best by eval loss.", minimum=0.0, changes="data")
    chat_template: str = setting("", "A file holding a Jinja chat template (`chat_template.jinja`, say) that renders every row and is saved with the model "
                                     "in place of the tokenizer's own (the fingerprint records its content). Empty = the tokenizer's own, ChatML when it "
                                     "has none.", changes="data")
    data_format: Literal["auto", "messages", "sharegpt", "prompt_completion", "alpaca", "text"] = setting("auto", "Row format: `messages` (role/content), "
        "`sharegpt` (`conversations` of from/value), `prompt_completion`, `alpaca` (`instruction`, optional `input`, `output`), "
        "or `text`; `auto` detects it from the columns ([row formats](data.md#row-formats-ft_data_format)).", changes="data")
    bad_rows: Literal["fail", "skip"] = setting("fail", "Rows that cannot be trained on (unknown role, empty reply, bad JSON, ...): "
                                                        "`fail` exits 2 listing them with their reasons, `skip` leaves them out and "
                                                        "counts them. Either way they are listed in `FT_OUTPUT_DIR/data-report.txt` "
                                                        "([bad rows](data.md#what-makes-a-row-bad-ft_bad_rows)).", changes="data")
    loss_on: Literal["all", "assistant"] = setting("all", "Tokens that carry loss: `all` (the reference recipe), or `assistant`, only the assistant's "
                                                          "replies and their end-of-turn token (Qwen3's stock template works; other templates need `{% "
                                                          "generation %}` markers; [what is trained](data.md#what-is-trained-ft_loss_on)).", changes="data")
    max_length: int = setting(4096, "Longest training sequence in tokens; longer rows follow `FT_TRUNCATION` "
                                    "([lengths](data.md#how-long-ft_max_length-ft_truncation)).", minimum=16, changes="data")
    truncation: Literal["truncate", "drop"] = setting("truncate", "Rows longer than `FT_MAX_LENGTH`: cut at the limit, or "
                                                                  "leave out (both counted).", changes="data")
    data_cache: bool = setting(True, "Keep the checked, tokenized data under `FT_OUTPUT_DIR/.fulltune/data-cache/`, keyed by "
                                     "data source, tokenizer and data settings, so a restart skips checking and tokenizing.")
    # -- Optimisation --------------------------------------------------------------------------------
    max_steps: int = setting(50, "Optimizer steps to train, unless `FT_NUM_EPOCHS` is set.", minimum=1, changes="training", group="Optimisation")
    num_epochs: float = setting(0.0, "Passes over the training rows (`3`, or a fraction); one epoch is ceil(rows / sequences per optimizer step) "
                                     "steps, the last one short. 0 = train `FT_MAX_STEPS` steps. Set, it wins over a preset's or the default step "
                                     "count; with `FT_MAX_STEPS` set as explicitly, `FT_MAX_STEPS` wins ([precedence](settings.md#precedence)).",
                                minimum=0.0, changes="training")
    learning_rate: float = setting(2e-05, "Peak learning rate of AdamW.", minimum=0.0, changes="training")
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = setting("linear", "Learning-rate schedule after warm-up.", changes="training")
    warmup_steps: int = setting(10, "Linear warm-up steps, unless `FT_WARMUP_RATIO` is set.", minimum=0, changes="training")
    warmup_ratio: float = setting(0.0, "Linear warm-up as a share of the training steps, rounded up (`0.03`, say; below 1); 0 = `FT_WARMUP_STEPS`. "
                                       "It wins over `FT_WARMUP_STEPS` as `FT_NUM_EPOCHS` wins over `FT_MAX_STEPS`.", minimum=0.0, changes="training")
    weight_decay: float = setting(0.01, "AdamW weight decay.", minimum=0.0, changes="training")
    max_grad_norm: float = setting(1.0, "Gradient clipping norm; 0 = no clipping.", minimum=0.0, changes="training")
    divergence_patience: int = setting(3, "Stop the job (exit 5) when the logged training loss is NaN, infinite or above "
                                          "`FT_LOSS_LIMIT` at this many logging steps in a row; 0 = never stop for the loss (a "
                                          "checkpoint whose weights are not finite is never committed either way).", minimum=0)
    loss_limit: float = setting(0.0, "A logged training loss above this counts towards `FT_DIVERGENCE_PATIENCE`; "
                                     "0 = only NaN and infinite losses do.", minimum=0.0)
    batch_size: int = setting(1, "Sequences per forward pass as the recipe states it; with `FT_BATCH_LAYOUT=auto` only "
                                 "the product with `FT_GRADIENT_ACCUMULATION_STEPS` (sequences per optimizer step) is "
                                 "kept, and the passes are regrouped to fill the device.", minimum=1, changes="training")
    gradient_accumulation_steps: int = setting(8, "Forward passes per optimizer step; effective batch = batch size × this.", minimum=1, changes="training")
    seed: int = setting(42, "Seed for the split, the data order and initialisation.", minimum=0, maximum=2**32 - 1, changes="data")  # numpy's seed range
    # -- Evaluation and checkpoints ------------------------------------------------------------------
    eval_steps: int = setting(25, "Evaluate every N optimizer steps.", minimum=1, group="Evaluation and checkpoints")
    eval_batch_size: int = setting(1, "Sequences per evaluation forward pass.", minimum=1)
    save_steps: int | Literal["auto"] = setting(25, "Commit a checkpoint every N optimizer steps, a multiple of `FT_EVAL_STEPS` (the best model is "
                                                    "chosen by eval loss at save time). `auto`: at the first evaluation step once the measured costs "
                                                    "allow one: saves block at most 5 % of the wall time and never wait for the one before "
                                                    "([choosing the cadence](checkpoints.md#choosing-the-cadence)).", minimum=1)
    save_every_minutes: float = setting(0.0, "Also commit a checkpoint at the first evaluation step (every `FT_EVAL_STEPS`) once "
                                             "this many minutes have passed since the last one, to bound the work a hard kill "
                                             "loses (with `FT_SAVE_STEPS=auto` too, past 5 % of the wall time if need be, never before the "
                                             "last save is written); 0 = by `FT_SAVE_STEPS` only. A stop signal saves anyway "
                                             "(docs/checkpoints.md says how to choose).", minimum=0.0)
    save_total_limit: int = setting(2, "Committed checkpoints to keep (the best one is kept as well).", minimum=1)
    early_stopping_patience: int = setting(0, "Stop training once eval loss has not improved for this many evaluations in a "
                                              "row (transformers' `EarlyStoppingCallback`), still exiting 0 with the best "
                                              "checkpoint as the final model; 0 = train all `FT_MAX_STEPS`.", minimum=0)
    eval_samples: int = setting(4, "Validation prompts the model answers greedily at step 0 and after every evaluation, the "
                                   "same ones each time (chosen with `FT_SEED`), written to `FT_OUTPUT_DIR/eval-samples.jsonl` "
                                   "and the MLflow run; 0 = none ([what they cost](memory-plan.md#sample-answers)).", minimum=0)
    eval_sample_tokens: int = setting(128, "Most new tokens per sample answer (an answer also ends at the end-of-turn token).", minimum=1)
    logging_steps: int = setting(10, "Log loss, learning rate and throughput every N optimizer steps.", minimum=1)
    output_dir: str = setting("/output", "The mounted volume: checkpoints, the final model, the MLflow store when no server is set.")
    # -- After training: did it help? (trainer/evaluation/) --------------------------------------
    eval_rows: int = setting(64, "Held-out validation rows that the base and the fine-tuned model each answer after training (greedy, at most "
                                 "`FT_EVAL_MAX_NEW_TOKENS`), scored against the rows' own replies by exact match and chrF; 0 = none "
                                 "([evaluation](tracking-and-serving.md#evaluation-did-the-fine-tune-help-and-what-did-it-forget)).",
                             minimum=0, group="After training: evaluation")
    eval_max_new_tokens: int = setting(256, "Most new tokens per answer of the `FT_EVAL_ROWS` score (an answer also ends at the end-of-turn token).",
                                       minimum=1)
    eval_tasks: str = setting("", "lm-evaluation-harness benchmarks that the base and the fine-tuned model are both scored on after training: "
                                  "comma-separated task names (`arc_easy,hellaswag`) and/or folders of task YAMLs of one's own (every task in "
                                  "them); empty = none ([a cheap forgetting check](tracking-and-serving.md#a-cheap-forgetting-check)).")
    eval_limit: int = setting(0, "Score each benchmark task on its first N samples only (a cheap check, labelled `limit N` wherever the "
                                 "numbers are shown); 0 = every sample.", minimum=0)
    eval_max_regression: float = setting(0.0, "The gate: when a benchmark's score falls by more than this against the base model "
                                              "(0.02 = two points of accuracy), the model is saved but not registered, and the job exits 9; "
                                              "0 = no gate.", minimum=0.0)
    eval_cache_dir: str = setting("", "Where the base model's benchmark scores are kept, one file per model, revision, task and limit, so a retry or "
                                      "the next job on the same base does not compute them again; empty = `FT_OUTPUT_DIR/.fulltune/base-scores`. "
                                      "A folder several jobs mount shares them.")
    # -- Object storage and the hub ------------------------------------------------------------
    mirror_url: str = setting("", "An object-store folder (`s3://`, `gs://`, `az://`) that receives each committed checkpoint in the background "
                                  "and the final model; a job on an empty volume resumes from it. Empty = none "
                                  "([object storage](checkpoints.md#object-storage)).",
                              group="Object storage and the hub")
    mirror_wait_seconds: int = setting(600, "How long the end of the job waits for `FT_MIRROR_URL` to take the final model and the last checkpoints; "
                                            "past it the job exits 8 with the model kept on the volume, and running it again only uploads.", minimum=0)
    push_to_hub: str = setting("", "A Hugging Face hub repository (`org/name`) that receives the final model and a model card at the end "
                                   "(`HF_TOKEN` with write access); empty = none ([the hub](checkpoints.md#hugging-face-hub)).")
    hub_private: bool = setting(True, "Create the `FT_PUSH_TO_HUB` repository private; a repository that exists keeps its visibility.")
    # -- Hardware ------------------------------------------------------------------------------------
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16-sr"] = setting("auto", "`auto`: `bf16-mixed` on a bf16-capable GPU, else `fp32`. `bf16-mixed` keeps "
                                                                                  "fp32 master weights and AdamW states and computes in bf16, so no update is "
                                                                                  "lost; `bf16-sr` (opt-in) keeps bf16 weights and fp32 AdamW states and "
                                                                                  "writes each update back with stochastic rounding, without `FT_OPTIMIZER` "
                                                                                  "([why, and what each costs](settings.md#the-reference-recipe)).",
                                                                                  changes="training", group="Hardware")
    activation_checkpointing: Literal["auto", "full", "selective", "off"] = setting("auto", "Recompute activations in the backward pass instead of keeping "
                                                                                            "them: `full` every decoder layer, `selective` every n-th layer "
                                                                                            "with n as large as the memory plan fits (every layer under "
                                                                                            "FSDP), `off` none. `auto` "
                                                                                            "takes the recomputation of the layout with the shortest "
                                                                                            "estimated step that fits, none on CPU ([the memory plan]"
                                                                                            "(memory-plan.md#the-preflight-memory-disk-and-host-memory)).")
    # -- Throughput ----------------------------------------------------------------------------------
    batch_layout: Literal["auto", "as-set"] = setting("auto", "`auto`: train each optimizer step's `FT_BATCH_SIZE` × `FT_GRADIENT_ACCUMULATION_STEPS` "
                                                              "sequences, in the same order and with the same updates, in the passes of the layout the "
                                                              "memory plan ranks fastest among those that fit; `as-set`: exactly `FT_BATCH_SIZE` "
                                                              "sequences per pass, as TRL does "
                                                              "([why](memory-plan.md#what-the-defaults-do)).", group="Throughput")
    padding_free: Literal["auto", "on", "off"] = setting("auto", "Concatenate the sequences of a forward pass into one row without "
                                                                 "padding (TRL's `padding_free`); each sequence still attends only to "
                                                                 "itself. `auto`: on ([measured](memory-plan.md#what-the-defaults-do)).")
    optimizer: Literal["auto", "adamw_torch", "adamw_torch_fused"] = setting("auto", "AdamW implementation; the update is the same. `auto`: the fused "
                                                                                     "kernel (one launch for all parameters) on GPU, the loop on CPU.")
    compile: bool = setting(False, "`torch.compile` the model. Off until measured on the target GPU: the first steps compile for minutes.")
    liger: bool = setting(False, "Liger Triton kernels for RMSNorm, SwiGLU and RoPE (needs the `liger-kernel` package and a GPU; without "
                                 "either, exit 2 at start). The loss never materialises the full logits either way: TRL computes it in chunks.")
    eval_max_samples: int = setting(0, "Evaluate on at most this many validation rows (the first ones "
                                       "of the split, always the same); 0 = all of them.", minimum=0)
    dataloader_workers: int = setting(0, "Background processes that collate batches; 0 = in the training process, which is enough because rows "
                                         "are tokenized up front ([measured](memory-plan.md#what-the-defaults-do)).", minimum=0, maximum=256)
    preflight: Literal["fail", "warn", "off"] = setting("fail", "Before loading weights: estimate peak GPU memory from the model config and check the volume "
                                                                "has room for the checkpoints. `fail`: exit 2 with the breakdown and the settings that would "
                                                                "fit; `warn`: print it and go on ([the preflight]"
                                                                "(memory-plan.md#the-preflight-memory-disk-and-host-memory)).")
    gpu_memory_gb: float = setting(0.0, "GPU memory the plan must fit, in GB; 0 = what the device reports. Set "
                                        "it to plan for a smaller card than the one at hand.", minimum=0.0)
    # -- Tracking and registry -----------------------------------------------------------------------
    registered_model: str = setting("main.default.qwen3_4b_assistant", "MLflow registered model name (`catalog.schema.model` on Unity Catalog), also the name "
                                                                       "the served model answers with; empty = do not register. Unset with another `FT_MODEL`: "
                                                                       "`main.default.<model name>_sft` ([names](preemption-and-failures.md#names)).",
                                    group="Tracking and registry")
    run_name: str = setting("", "MLflow run name; empty = `<model name>_full-fine-tuning`, the model's name without its path "
                                "([names](preemption-and-failures.md#names)).")
    system_metrics: bool = setting(True, "Log CPU/GPU/memory system metrics to the MLflow run.")
    registration_retry_seconds: int = setting(600, "How long the end of the job waits for an MLflow server that does not answer, to send held-back metrics, "
                                                   "register and close the run; past it the job exits 3 with the model kept on the volume, and running it "
                                                   "again registers without training. 0 = one try ([outages](tracking-and-serving.md#mlflow)).", minimum=0)
    # -- Operations ----------------------------------------------------------------------------------
    platform: Literal["auto", "none", "sagemaker", "vertex", "aws-batch", "azureml"] = setting("auto", "Batch platform whose variables fill in unset `FT_*` "
        "settings; `auto` detects it, `none` ignores them.", group="Operations")
    stop_deadline_seconds: int = setting(270, "After SIGTERM/SIGINT the job finishes the current optimizer step and commits a checkpoint; past "
                                              "this many seconds it gives up (exit 76). Keep it below the platform's grace period; on SageMaker it "
                                              "defaults to 100 ([grace periods](preemption-and-failures.md#preemption-and-resume)).", minimum=1)
    allow_config_change: bool = setting(False, "Resume checkpoints on the volume even though model, data or hyperparameters changed since they were written.")
    lease_seconds: int = setting(60, "How long a job's lease on `FT_OUTPUT_DIR` may go unrefreshed before another job takes it over; it is refreshed every "
                                     "third of this, and a second job started on the volume exits 7 within about that third. Keep it above the longest time "
                                     "the volume may stall writes ([the lease](preemption-and-failures.md#preemption-and-resume)).", minimum=3)
    termination_message_path: str = setting("/dev/termination-log", "File that receives a one-line reason on every non-zero "
                                                                    "exit (read by Kubernetes); empty = none.")
    log_level: Literal["info", "debug"] = setting("info", "What the job's log shows: `info`, fulltune's own lines (MLflow's and other libraries' INFO "
                                                          "lines left out); `debug` adds those and the start-up stage timings "
                                                          "([log levels](tracking-and-serving.md#log-levels-ft_log_level)).")
    # -- Monitoring ----------------------------------------------------------------------------------
    metrics_port: int = setting(0, "Port of rank 0's Prometheus endpoint (`/metrics`: step, loss, tokens/s, MFU, memory, checkpoint cost, "
                                   "seconds since the last optimizer step); 0 = none ([the metrics](deployment.md#metrics)).",
                                minimum=0, maximum=65535, group="Monitoring")
    stuck_after_seconds: int = setting(1800, "Seconds without an optimizer step, while training, after which the job logs that it is stuck (once) "
                                             "and `fulltune_stuck` turns 1; keep it above the longest evaluation or checkpoint pause. 0 = never.",
                                       minimum=0)
    stuck_exit: bool = setting(False, "A stuck job also ends, with exit 77 (a retry resumes from the last committed checkpoint), so that the "
                                      "scheduler can start it again, on another node if it picks one.")
    # -- Scaling out ---------------------------------------------------------------------------
    num_processes: int = setting(0, "Training processes on this node, one per GPU; 0 = every visible GPU (1 on CPU). More than one "
                                    "multiplies the effective batch: `FT_BATCH_SIZE` × `FT_GRADIENT_ACCUMULATION_STEPS` × processes "
                                    "([scaling out](gpus.md#several-gpus-and-nodes)).", minimum=0, changes="training", group="Scaling out")
    distributed: Literal["auto", "none", "ddp", "fsdp"] = setting("auto", "How several processes share the model: `ddp` gives each the whole "
                                                                          "model and averages gradients, `fsdp` shards weights, gradients "
                                                                          "and AdamW states across them (FSDP2, per decoder layer). `auto`: "
                                                                          "none for one process, else `ddp` when the memory plan fits a "
                                                                          "whole model per GPU, else `fsdp` ([scaling out](gpus.md#several-gpus-and-nodes)).")
    num_nodes: int = setting(1, "Machines (pods) training together, each running this image with the same settings and its own "
                                "`FT_NODE_RANK` on a volume every node mounts (ReadWriteMany). Filled in from Kubeflow "
                                "Trainer's `PET_NNODES`, or `WORLD_SIZE` (PyTorchJob, Volcano).", minimum=1, changes="training")
    node_rank: int = setting(0, "This machine's index, 0 to `FT_NUM_NODES` - 1; node 0 hosts rank 0, which logs, commits checkpoints and saves the model. "
                                "Filled in from `PET_NODE_RANK`, `RANK` (PyTorchJob, Volcano) or an Indexed Job's `JOB_COMPLETION_INDEX`.", minimum=0)
    master_addr: str = setting("", "Host name or address of node 0 (rendezvous); empty = this machine (one node). Filled in from "
                                   "`PET_MASTER_ADDR` or `MASTER_ADDR`; for an Indexed Job use its pod host name, `<job>-0.<headless service>`.")
    master_port: int = setting(29500, "Port of the rendezvous on node 0. Filled in from `PET_MASTER_PORT` or `MASTER_PORT`.", minimum=1)
    collective_timeout_seconds: int = setting(1800, "How long a rank waits in a collective (all-reduce, barrier) before the job "
                                                    "fails. Keep it above the slowest checkpoint save or evaluation on rank 0, "
                                                    "which the other ranks wait for ([scaling out](gpus.md#what-holds-with-several-processes)).", minimum=60)
    rendezvous_timeout_seconds: int = setting(1800, "Several nodes: how long each node waits at the rendezvous for the others to start (a pod "
                                                    "still pending, pulling the image or attaching the volume) before it exits 1 "
                                                    "([scaling out](gpus.md#several-nodes-meeting)).", minimum=10)
    # Not a variable: which platform's variables filled in unset settings (`platforms.py`), for the logs.
    detected_platform: str = "none"


TABLE = rows(Settings)
BY_ENV_NAME = {s.env_name: s for s in TABLE}


def load(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse and validate every `FT_*` variable; raise one ConfigError listing all problems."""
    from environs import EnvValidationError

    from trainer.core import locations, precedence

    environ = dict(os.environ if environ is None else environ)
    unknown = sorted(k for k in environ if k.upper().startswith(PREFIX) and k not in BY_ENV_NAME)  # `ft_max_steps` too: never ignored silently
    platform, levels = precedence.layers(environ)
    layered = precedence.layered(levels)
    env = precedence.reader(layered)
    values = {s.name: s.read(env, layered.get(s.env_name)) for s in TABLE}
    for name in precedence.losers(levels) & {"FT_NUM_EPOCHS", "FT_WARMUP_RATIO"}:  # FT_MAX_STEPS (FT_WARMUP_STEPS) set as explicitly: it wins
        values[BY_ENV_NAME[name].name] = 0.0
    values["output_dir"] = locations.real_path(values["output_dir"])  # one spelling of each local path before anything compares or stores it
    for name, data in (("model", False), ("dataset", True), ("eval_dataset", True)):
        values[name] = locations.normalised(values[name], data=data)
    values["chat_template"] = locations.real_path(values["chat_template"])  # a file, always local
    names, folders = locations.eval_task_entries(values["eval_tasks"])
    values["eval_tasks"] = ",".join(names + folders)
    values["eval_cache_dir"] = locations.real_path(values["eval_cache_dir"])
    if "FT_REGISTERED_MODEL" not in layered:  # the seed's name for the seed's model only: a 0.4M-parameter model is no qwen3_4b_assistant
        values["registered_model"] = locations.registered_name(values["model"])
    problems: dict[str, str] = {}
    try:
        env.seal()
    except EnvValidationError as error:
        for name, messages in error.error_messages.items():
            problems[name] = "; ".join(str(m).rstrip(".") for m in messages) + f" (allowed: {BY_ENV_NAME[name].allowed})"
    for name in unknown:
        problems[name] = refusals.not_a_setting(name, BY_ENV_NAME)
    # With the per-variable ones, in the same error: each rule whose settings all parsed
    problems.update(refusals.cross_checks(values, invalid={BY_ENV_NAME[name].name for name in problems if name in BY_ENV_NAME}))
    if not problems:
        values = {k: v + 0.0 if isinstance(v, float) else v for k, v in values.items()}  # -0 is 0: the same fingerprint, the same params
    if problems:
        lines = [f"  {name}={refusals.shown(name, layered.get(name))!s}: {why}" for name, why in sorted(problems.items())]
        raise ConfigError(f"{len(problems)} invalid setting(s):\n" + "\n".join(lines))
    return Settings(**values, detected_platform=platform)


def as_params(settings: Settings) -> dict[str, str]:
    """The effective configuration as MLflow params: every FT_* value, nothing else (no setting holds a secret:
    tokens and passwords come through their own libraries' variables, HF_TOKEN, MLFLOW_TRACKING_PASSWORD)."""
    params = {s.env_name: str(getattr(settings, s.name)) for s in TABLE}
    params["detected_platform"] = settings.detected_platform
    return params


def changing(settings: Settings, what: tuple[str, ...]) -> dict[str, Any]:
    """The values of the settings whose `changes` is in `what`: the data cache key takes ("data",), the
    resume fingerprint ("data", "training")."""
    return {s.name: getattr(settings, s.name) for s in TABLE if s.changes in what}
