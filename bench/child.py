"""One variant of the benchmark, in its own process (started by bench/run.py)."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from typing import Any


def _timer(t0: float):
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.train_s, self.first_step_s, self.started = 0.0, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.train_s += time.perf_counter() - self.started
            if self.first_step_s is None:
                self.first_step_s = time.time() - t0

    return Timer()


def _gpu_model(model_dir: str, dtype: Any) -> Any:
    """Random-init weights from config.json, the same for every variant (built in fp32, then cast)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return net.to(dtype)


def _splits(work: str):
    from datasets import load_dataset

    dataset = load_dataset("json", data_files=os.path.join(work, "data", "train.jsonl"))
    return dataset["train"].train_test_split(test_size=0.1, seed=42)


def literal(args, work: str, cuda: bool, timer) -> Any:
    """The seed notebook's cells, changed only where today's libraries or the benchmark require it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir = os.path.join(work, "model")
    bf16 = cuda and not args.literal_fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _gpu_model(model_dir, dtype) if cuda else AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True, use_fast=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = _splits(work)
    training_args = SFTConfig(
        output_dir=os.path.join(work, "out-literal"),
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=8,
        learning_rate=2e-5,
        max_steps=args.steps,
        eval_steps=args.eval_steps,
        logging_steps=1,  # the seed logs every 10; every step here, for the loss-parity comparison
        save_steps=args.eval_steps * (args.steps // args.eval_steps + 1),  # the seed's 25: after the last step
        save_total_limit=2,
        report_to="none" if args.no_mlflow else "mlflow",
        warmup_steps=10,
        weight_decay=0.01,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        eval_strategy="steps",
        save_strategy="steps",
        load_best_model_at_end=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        bf16=bf16,
        use_cpu=not cuda,
        activation_checkpointing=True,  # the seed's `gradient_checkpointing`, renamed in TRL 1.x
        activation_checkpointing_kwargs={"use_reentrant": False},
        max_length=args.max_length,  # the seed left TRL's default (1024); the same limit for both variants here
        disable_tqdm=True,
    )
    return SFTTrainer(model=model, args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"], processing_class=tokenizer, callbacks=[timer])


def fulltune_env(args, work: str, name: str, overrides: dict[str, str]) -> dict[str, str]:
    save = args.eval_steps * (args.steps // args.eval_steps + 1)  # after the last step, like the seed's 25
    env = {
        "FT_MODEL": os.path.join(work, "model"),
        "FT_DATASET": os.path.join(work, "data", "train.jsonl"),
        "FT_OUTPUT_DIR": os.path.join(work, f"out-{name}"),
        "FT_MAX_STEPS": str(args.steps),
        "FT_EVAL_STEPS": str(args.eval_steps),
        "FT_SAVE_STEPS": str(save),
        "FT_LOGGING_STEPS": "1",
        "FT_MAX_LENGTH": str(args.max_length),
        "FT_REGISTERED_MODEL": "",
        "FT_TERMINATION_MESSAGE_PATH": "",
    }
    return env | overrides


def fulltune(args, work: str, name: str, overrides: dict[str, str], cuda: bool, timer) -> Any:
    """This project's job, stage by stage as trainer/job.py runs it (without the final save)."""
    import torch
    from trl import SFTTrainer

    from trainer import data, memory, model, progress, recipe
    from trainer import settings as settings_table

    settings = settings_table.load(fulltune_env(args, work, name, overrides))
    precision = model.resolve_precision(settings, cuda, cuda and torch.cuda.is_bf16_supported())
    plan = memory.preflight(settings, precision, cuda)
    tokenizer = model.load_tokenizer(settings)
    if hasattr(data, "prepare"):
        prepared = data.prepare(settings, tokenizer)
        train_rows, eval_rows = prepared.train, prepared.eval
    else:
        train_rows, eval_rows = data.load_splits(settings)
    if cuda:
        net = _gpu_model(settings.model, torch.float32)
        net.config.pad_token_id = tokenizer.pad_token_id
    else:
        net = model.load_model(settings, tokenizer)
    net = recipe.prepare_model(net, settings, cuda)
    config = recipe.sft_config(settings, precision, plan, cuda)
    if args.no_mlflow:
        config.report_to = []
    trainer = SFTTrainer(
        model=net,
        args=config,
        data_collator=recipe.collator(settings, tokenizer, cuda),
        train_dataset=train_rows,
        eval_dataset=recipe.eval_rows(settings, eval_rows),
        processing_class=tokenizer,
        callbacks=[progress.Progress(net.config, net.num_parameters(), settings.batch_size * settings.gradient_accumulation_steps, cuda), timer],
    )
    trainer.bench_layout = f"{plan.sequences_per_pass}x{plan.passes_per_step}, {memory.checkpointing_label(plan.checkpoint_every, plan.layers)}, {'on' if recipe.padding_free(settings, cuda) else 'off'}"
    return trainer


def eval_loss(net: Any, tokenizer: Any, work: str, max_length: int, cuda: bool) -> float:
    """Token-weighted NLL of the whole validation split, one sequence at a time."""
    import torch

    net.eval()
    total, count = 0.0, 0
    device = next(net.parameters()).device
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        for row in _splits(work)["test"]:
            ids = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)[:max_length]
            ids = torch.tensor([ids], device=device)
            logits = net(input_ids=ids, use_cache=False).logits.float()
            total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def run(args) -> dict:
    import contextlib

    import torch

    work, name, overrides = args.work, args.child, json.loads(args.overrides)
    cuda = args.gpu and torch.cuda.is_available()
    if args.gpu and not cuda:
        raise SystemExit("--gpu: no CUDA device here")
    os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + os.path.join(work, f"mlflow-{name}.db"))
    timer = _timer(args.t0)
    trainer = literal(args, work, cuda, timer) if name == "literal" else fulltune(args, work, name, overrides, cuda, timer)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if args.no_mlflow:
        context = contextlib.nullcontext()
    else:
        import mlflow

        context = mlflow.start_run(run_name=f"bench-{name}", log_system_metrics=True)
    with context:
        started = time.perf_counter()
        trainer.train()
        in_train = time.perf_counter() - started
    tokens = float(trainer._total_train_tokens)
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    result = {
        "tokens": tokens,
        "train_s": timer.train_s,
        "tokens_per_s": tokens / timer.train_s,
        "first_step_s": timer.first_step_s,
        "eval_s": in_train - timer.train_s,
        "peak_gb": peak,
        "losses": losses,
        "trainer_eval_loss": evals[-1] if evals else None,
        "layout": getattr(trainer, "bench_layout", "1x8, on, off"),
    }
    if cuda:
        from trainer import progress

        net = trainer.model
        flops = progress.flops_per_token(net.config, net.num_parameters(), tokens / (args.steps * 8))
        result["mfu"] = result["tokens_per_s"] * flops / (progress.peak_flops(torch.cuda.get_device_name(0)) or math.inf)
    result["eval_loss"] = eval_loss(trainer.model, trainer.processing_class, work, args.max_length, cuda)
    return result


def dry_run(args, work: str) -> None:
    """Memory plans for the fulltune settings on an 80 GB GPU (H100), from config.json alone."""
    from trainer import memory, model
    from trainer import settings as settings_table

    base = fulltune_env(args, work, "dry-run", dict(s.split("=", 1) for s in args.set))
    for extra in ({}, {"FT_MAX_LENGTH": "4096"}, {"FT_BATCH_LAYOUT": "as-set"}):
        env = base | {"FT_GPU_MEMORY_GB": base.get("FT_GPU_MEMORY_GB", "80"), "FT_PREFLIGHT": "warn"} | extra
        settings = settings_table.load(env)
        print(f"bench: dry run {extra or 'defaults'}, FT_MAX_LENGTH={settings.max_length}:", flush=True)
        chosen = memory.preflight(settings, "bf16-mixed", cuda=False)
        config = model.read_config(settings)
        n = model.parameter_count(config)
        print(f"bench:   {n / 1e9:.3f}B parameters; chosen {chosen.describe()}", flush=True)
