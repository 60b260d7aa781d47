"""One run of one variant of the benchmark, in its own process (started by bench/run.py).

- `literal`: the seed notebook's `SFTTrainer` call, written out by hand: that is its point.
- `fulltune` and every `--variant`: the job's own trainer, `trainer.sft_trainer.build_trainer`, on a `Config` built
  from `FT_*` values as entrypoint.py builds it, after the same stages `job.run` runs before it (memory
  plan, tokenizer, `data.prepare`).  Nothing here re-creates the job's `SFTTrainer` setup, so the benchmark
  measures what users run.  On GPU the weights are a random-init model built on the device (`net=`).
- `gemm`: the float32 matrix-multiply peak of this CPU, with the threads the other children use.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import time
from typing import Any

WARMUP_STEPS = 2  # left out of tokens/s and MFU: Triton's JIT of TRL's kernels, cuBLAS and FlashAttention's first launches, AdamW's state


def _timer(t0: float, cuda: bool = False, warmup: int = WARMUP_STEPS):
    """Times the optimizer steps after the first `warmup` (at least one is kept), and their tokens; on a GPU it waits for
    the device at each step boundary, so a step's host time is its device time (the benchmark only: the job never
    syncs here).  It also reads the device's own memory use at each step end (`mem_get_info`: the context and what
    the caching allocator holds)."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.restart(None)
            self.first_step_s = None

        def restart(self, trainer) -> None:
            """A new trainer (the first, or the next one down after an out-of-memory error): count its steps only."""
            self.trainer, self.steps, self.train_s, self.tokens, self.started, self.before = trainer, 0, 0.0, 0.0, None, 0.0
            self.device_used = 0.0

        def _sync(self) -> None:
            if cuda:
                import torch

                torch.cuda.synchronize()

        def on_step_begin(self, args, state, control, **kwargs):
            self._sync()
            self.started = time.perf_counter()
            self.before = float(getattr(self.trainer, "_total_train_tokens", 0))

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            took = time.perf_counter() - self.started
            self.steps += 1
            if self.steps > warmup or (state.global_step >= state.max_steps and not self.train_s):
                self.train_s += took
                self.tokens += float(getattr(self.trainer, "_total_train_tokens", 0)) - self.before
            if self.first_step_s is None:
                self.first_step_s = time.time() - t0
            if cuda:
                import torch

                free, total = torch.cuda.mem_get_info()
                self.device_used = max(self.device_used, float(total - free))

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


def save_steps(args) -> int:
    """`--save-steps`, or after the last step (the seed's 25 with 20 steps)."""
    return args.save_steps or args.eval_steps * (args.steps // args.eval_steps + 1)


def without_checkpoints(trainer: Any, args) -> None:
    """Unless `--save-steps` or the variant asks for them (the `save` variant), write no checkpoint: transformers saves at
    the last step whatever `save_steps` says (DefaultFlowCallback), and a Qwen3-4B checkpoint is 48 GB (two do not fit
    the GPU machine's disk) and a minute of writing that is not what the variants compare."""
    from transformers.trainer_utils import SaveStrategy

    if not args.save_steps and not getattr(args, "keep_saving", False):
        trainer.args.save_strategy = SaveStrategy.NO  # read at each step end; with no checkpoint, the best-model load is skipped


def run_dir(args, work: str, name: str) -> str:
    """A fresh output folder per variant and round: no data cache or checkpoint carries over between runs."""
    return os.path.join(work, f"out-{name}-r{args.round}")


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
        output_dir=run_dir(args, work, "literal"),
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=8,
        learning_rate=2e-5,
        max_steps=args.steps,
        eval_steps=args.eval_steps,
        logging_steps=1,  # the seed logs every 10; every step here, for the loss-parity comparison
        save_steps=save_steps(args),  # the seed's 25
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
    trainer = SFTTrainer(
        model=model, args=training_args, train_dataset=dataset["train"], eval_dataset=dataset["test"], processing_class=tokenizer, callbacks=[timer]
    )
    trainer.bench_layout = "1x8, every layer, off"
    without_checkpoints(trainer, args)
    timer.restart(trainer)
    return trainer


def fulltune_env(args, work: str, name: str, overrides: dict[str, str]) -> dict[str, str]:
    env = {
        "FT_PLATFORM": "none",  # the machine's own variables (SageMaker, ...) do not steer the benchmark
        "FT_MODEL": os.path.join(work, "model"),
        "FT_DATASET": os.path.join(work, "data", "train.jsonl"),
        "FT_OUTPUT_DIR": run_dir(args, work, name),
        "FT_MAX_STEPS": str(args.steps),
        "FT_EVAL_STEPS": str(args.eval_steps),
        "FT_SAVE_STEPS": str(save_steps(args)),
        "FT_LOGGING_STEPS": "1",
        "FT_MAX_LENGTH": str(args.max_length),
        "FT_REGISTERED_MODEL": "",
        "FT_TERMINATION_MESSAGE_PATH": "",
    }
    return env | overrides


def fulltune_config(args, work: str, name: str, overrides: dict[str, str], cuda: bool) -> Any:
    """The job's configuration for these `FT_*` values, built as entrypoint.py builds it (device given, not probed)."""
    import torch

    from trainer.core import config as job_config
    from trainer.core import settings as settings_table

    settings = settings_table.load(fulltune_env(args, work, name, overrides))
    return job_config.build(settings, cuda=cuda, bf16_supported=cuda and torch.cuda.is_bf16_supported())


def fulltune(config: Any, timer: Any = None, tracker: Any = None, plan: Any = None, callbacks: tuple = (), args: Any = None) -> Any:
    """The job's trainer: the stages trainer/job.py runs before training, then `sft_trainer.build_trainer` itself
    (`tracker`: the job's MLflow run, none with --no-mlflow; `plan`: the memory plan to train with, as the job's
    step-down passes it; default the preflight's)."""
    from trainer import sft_trainer
    from trainer.data import prepare as data
    from trainer.model import loading as model
    from trainer.model import memory, recipe

    settings = config.settings
    plan = plan or memory.preflight(config)
    tokenizer = model.load_tokenizer(settings)
    prepared = data.prepare(settings, tokenizer)
    net = None
    if config.cuda:  # random-init weights built on the GPU, in the precision's weight dtype (bf16 for bf16-sr)
        net = _gpu_model(settings.model, config.precision.dtype())
        net.config.pad_token_id = tokenizer.pad_token_id
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan, tracker=tracker, net=net,
                                        callbacks=((timer,) if timer is not None else ()) + callbacks)
    layout = f"{plan.sequences_per_pass}x{plan.passes_per_step}, {memory.checkpointing_label(plan.checkpoint_every, plan.layers)}"
    trainer.bench_layout = f"{layout}, {'on' if recipe.padding_free(settings, config.cuda) else 'off'}"
    trainer.bench_plan_gb = plan.peak / 1e9
    if args is not None:
        without_checkpoints(trainer, args)
    if timer is not None:
        timer.restart(trainer)
    return trainer


def fulltune_stepping_down(config: Any, timer: Any, tracker: Any = None, args: Any = None) -> tuple[Any, int, float]:
    """Train the fulltune variant as job.train does: out of memory, the next plan down (trainer/model/stepdown.py);
    returns the trainer that finished, how many times it stepped down, and the seconds its `train()` took."""
    from trainer.model import memory, stepdown

    ladder = stepdown.Ladder(config, memory.preflight(config))
    took = []

    def attempt(plan: Any, watch: Any) -> Any:
        trainer = fulltune(config, timer, tracker, plan=plan, callbacks=(watch,), args=args)
        started = time.perf_counter()
        trainer.train()
        took.append(time.perf_counter() - started)
        return trainer

    trainer = ladder.run(attempt)
    return trainer, len(ladder.record.get("out_of_memory", [])), took[-1]


def _attention(trainer: Any) -> str:
    """Which attention trained, and what the self-check said (bench/gpu_check.sh prints it per variant)."""
    from trainer.model import attention

    name, why = trainer.model.config._attn_implementation, attention.decided()
    if why and name in (attention.NAME, attention.NATIVE):
        return why
    return "per-sequence SDPA loop (no CUDA: no self-check)" if name == attention.NAME else name


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


def gemm(seconds: float = 3.0, sizes: tuple[int, ...] = (1024, 2048)) -> dict:
    """fp32 matrix-multiply FLOP/s on this CPU with torch's default threads (those the training children use).

    For each size: warm up, then time single matmuls for `seconds`; the best one is the peak, the median
    says how much of it the machine gave during the measurement.
    """
    import torch

    best, medians = {}, {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(2):
            torch.mm(a, b)
        times, until = [], time.perf_counter() + seconds
        while time.perf_counter() < until or len(times) < 3:
            started = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - started)
        best[n], medians[n] = 2 * n**3 / min(times), 2 * n**3 / statistics.median(times)
    return {"peak_flops": max(best.values()), "median_flops": max(medians.values()), "by_size": {str(n): best[n] for n in sizes},
            "threads": torch.get_num_threads()}


def model_for(work: str, name: str) -> str:
    """The model folder for `BENCH_MODEL=<name>` (a config of bench/configs/): the benchmark's tokenizer with that config,
    its weights built at random on the GPU as for the 4B."""
    folder = os.path.join(work, f"model-{name}")
    if not os.path.isdir(folder):
        import shutil

        shutil.copytree(os.path.join(work, "model"), folder + ".partial", dirs_exist_ok=True)
        shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", name, "config.json"), os.path.join(folder + ".partial", "config.json"))
        os.replace(folder + ".partial", folder)
    return folder


def cap_memory(card_gb: float) -> str | None:
    """Let this process's caching allocator hold at most `card_gb` GB (a card smaller than the one at hand: an 80 GB H100
    on an H200), so a plan meets the card it was made for and an out-of-memory error is CUDA's own, raised where that
    card would raise it.  The CUDA context and NCCL's buffers are outside the allocator: they are not capped."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    if not card_gb or card_gb * 1e9 >= total:
        return None
    torch.cuda.set_per_process_memory_fraction(card_gb * 1e9 / total)
    return f"the allocator capped at {card_gb:g} GB of the device's {total / 1e9:.1f} GB"


def _saves(trainer: Any) -> dict:
    """What the checkpoints cost (the job's own accounting, trainer/checkpointing/saving.py), when any was written."""
    from trainer.checkpointing.commits import CommitCheckpoints

    saver = next((c for c in trainer.callback_handler.callbacks if isinstance(c, CommitCheckpoints)), None)
    if saver is None or not saver.costs.blocked:
        return {}
    costs = saver.costs
    return {"saves": len(costs.blocked), "save_first_blocked_s": costs.blocked[0], "save_blocked_s": costs.blocked[-1],
            "save_background_s": max(costs.background, default=0.0), "checkpoint_gb": costs.bytes / 1e9}


def run(args) -> dict:
    import contextlib

    work, name, overrides = args.work, args.child, json.loads(args.overrides)
    # before trainer.tracking is imported: it reads the URI once
    os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + os.path.join(work, f"mlflow-{name}-r{args.round}.db"))
    load_before = os.getloadavg()[0]
    if name == "gemm":
        return gemm() | {"load_avg": [load_before, os.getloadavg()[0]]}

    import torch

    cuda = args.gpu and torch.cuda.is_available()
    if args.gpu and not cuda:
        raise SystemExit("--gpu: no CUDA device here")
    card = float(overrides.pop("BENCH_CARD_GB", "") or overrides.get("FT_GPU_MEMORY_GB", "") or args.card_gb)
    capped = cap_memory(card) if cuda else None
    if capped:
        print(f"bench: {name}: {capped}", flush=True)
    args.keep_saving = "FT_SAVE_STEPS" in overrides  # the save variant's checkpoints
    if model := overrides.pop("BENCH_MODEL", ""):
        overrides["FT_MODEL"] = model_for(work, model) if cuda else os.path.join(work, "model")  # on CPU the tiny model
    timer = _timer(args.t0, cuda)
    context: Any = contextlib.nullcontext()
    if name == "literal":
        trainer = literal(args, work, cuda, timer)
        if not args.no_mlflow:
            import mlflow

            context = mlflow.start_run(run_name=f"bench-{name}", log_system_metrics=True)
    else:
        from trainer.model import attention

        if overrides.pop("BENCH_ATTENTION", "") == "loop":  # the varlen-vs-loop comparison on one card
            attention.prefer_loop("chosen by the benchmark")
        for fault in [k for k in overrides if k.startswith("FAULT_")]:  # gpu_check.sh --dry-run: tests/faults, before trainer.model.recipe is imported
            os.environ[fault] = overrides.pop(fault)
        config = fulltune_config(args, work, name, overrides, cuda)
        tracker = None
        if not args.no_mlflow:  # the job's own MLflow run, as job.run opens it around training
            from trainer.tracking.run import Tracker

            tracker = Tracker(config)
            tracker.start()
            context = tracker
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if name == "literal":
        with context:
            started = time.perf_counter()
            trainer.train()
            in_train = time.perf_counter() - started
        stepdowns = 0
    else:
        with context:
            trainer, stepdowns, in_train = fulltune_stepping_down(config, timer, tracker, args)
    tokens = float(trainer._total_train_tokens)
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]

    from trainer.console import progress

    net = trainer.model
    timed = timer.tokens or tokens  # the steps after the warm-up (all of them if there were no more)
    flops_per_token = progress.flops_per_token(net.config, net.num_parameters(), tokens / (max(trainer.state.global_step, 1) * 8))
    result = {
        "tokens": tokens,
        "timed_tokens": timed,
        "train_s": timer.train_s,
        "tokens_per_s": timed / timer.train_s,
        "first_step_s": timer.first_step_s,
        "eval_s": in_train - timer.train_s,
        "peak_gb": peak,
        "flops_per_token": flops_per_token,
        "model_flops": timed / timer.train_s * flops_per_token,  # model FLOP/s inside the timed optimizer steps (recomputation not counted)
        "losses": losses,
        "trainer_eval_loss": evals[-1] if evals else None,
        "layout": trainer.bench_layout,
        "attention": _attention(trainer),
        "stepdowns": stepdowns,
        **({"plan_gb": trainer.bench_plan_gb} if hasattr(trainer, "bench_plan_gb") else {}),
        **({"capped_gb": card} if capped else {}),
        **_saves(trainer),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if cuda else "",
        "torch": torch.__version__,
    }
    if cuda:
        result["reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        result["device_used_gb"] = timer.device_used / 1e9  # total - free at the step ends: with the context and NCCL's buffers
        result["mfu"] = result["model_flops"] / (progress.peak_flops(torch.cuda.get_device_name(0)) or math.inf)
    result["eval_loss"] = eval_loss(trainer.model, trainer.processing_class, work, args.max_length, cuda)
    result["load_avg"] = [load_before, os.getloadavg()[0]]
    return result


def dry_run(args, work: str) -> None:
    """Memory plans for the fulltune settings on an 80 GB GPU (H100), from config.json alone."""
    from trainer.core import settings as settings_table
    from trainer.core.config import PRECISIONS
    from trainer.model import loading as model
    from trainer.model import memory

    base = fulltune_env(args, work, "dry-run", dict(s.split("=", 1) for s in args.set))
    for extra in ({}, {"FT_MAX_LENGTH": "4096"}, {"FT_BATCH_LAYOUT": "as-set"}, {"FT_PRECISION": "bf16-sr"}):
        env = base | {"FT_GPU_MEMORY_GB": base.get("FT_GPU_MEMORY_GB", "80"), "FT_PREFLIGHT": "warn"} | extra
        settings = settings_table.load(env)
        precision = PRECISIONS["bf16-sr" if settings.precision == "bf16-sr" else "bf16-mixed"]  # as on a bf16 GPU
        print(f"bench: dry run {extra or 'defaults'}, FT_MAX_LENGTH={settings.max_length}, {precision.name}:", flush=True)
        config = model.read_config(settings)  # the plan alone: preflight's trust check wants weights, and the GPU run builds them at random
        n = model.parameter_count(config)
        chosen = memory.plan(config, n, settings, precision, memory.device_capacity(settings, cuda=False), settings.activation_checkpointing)
        print(f"bench:   {n / 1e9:.3f}B parameters; chosen {chosen.describe()}", flush=True)
