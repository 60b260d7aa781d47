"""The reference recipe as a TRL `SFTConfig`: the seed notebook's hyperparameters, adapted to today's TRL.

Where we differ from the notebook on purpose:
- precision: fp32 master weights with bf16 autocast instead of bf16 weights updated in place; or, opt-in
  (`FT_PRECISION=bf16-sr`), bf16 weights updated by our AdamW with stochastic rounding (trainer/model/optim.py);
- `activation_checkpointing` replaces the deprecated `gradient_checkpointing` name, and how many layers
  recompute is chosen by the memory plan (trainer/model/memory.py): every n-th layer (transformers'
  `every_n_layers`, 0 = none; on a GPU their inputs possibly offloaded to host memory, transformers' `offload`),
  in the layout its cost model (trainer/model/step_cost.py) ranks fastest among those that fit, and none on CPU;
- batch layout (`FT_BATCH_LAYOUT=auto`): the notebook's 1 sequence x 8 accumulation passes become the
  passes of that fastest layout (8 x 1 on CPU).  Each optimizer step sees the same 8 sequences in
  the same order, and the loss is normalised by the step's token count either way, so the updates are
  the same (bench/RESULTS.md: per-step loss within 1 %);
- evaluation runs at the training pass's batch size (or `FT_EVAL_BATCH_SIZE` if larger), optionally on
  the first `FT_EVAL_MAX_SAMPLES` validation rows only;
- padding-free passes (`FT_PADDING_FREE`) through our per-sequence attention (trainer/model/attention.py);
- fused AdamW on GPU (`FT_OPTIMIZER`), optional `torch.compile` (`FT_COMPILE`) and Liger kernels (`FT_LIGER`);
- retention is done by checkpoints.CommitCheckpoints (`save_total_limit` is left unset here);
- `report_to="none"`: tracking.MetricsCallback logs the Trainer's metrics into the job's one MLflow run.

The loss never materialises the full (tokens x vocabulary) logits: TRL 1.16 computes it in chunks.
"""

from __future__ import annotations

from typing import Any

from trainer.core.config import Precision
from trainer.core.schedule import Schedule
from trainer.core.settings import Settings
from trainer.core.volume import Volume


def padding_free(settings: Settings, cuda: bool) -> bool:
    """`auto`: on, on every device: measured 2.3x the padded layout's tokens/s on CPU (bench/RESULTS.md);
    on GPU pending measurement (bench/gpu_check.sh runs both)."""
    return settings.padding_free in ("auto", "on")


def optimizer(settings: Settings, cuda: bool) -> str:
    if settings.optimizer == "auto":
        return "adamw_torch_fused" if cuda else "adamw_torch"
    return settings.optimizer


def optimizer_cls_and_kwargs(precision: Precision, args: Any) -> Any:
    """For bf16-sr, our AdamW (trainer/model/optim.py) for the Trainer to build, so it still makes the weight-decay
    groups and the scheduler and saves/loads the optimizer state (with the rounding generator) in checkpoints;
    else None (`optim` decides)."""
    if not precision.stochastic_rounding:
        return None
    from trainer.model.optim import StochasticRoundingAdamW

    return StochasticRoundingAdamW, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "seed": args.seed}


def prepare_model(net: Any, settings: Settings, cuda: bool, precision: Precision | None = None) -> Any:
    """Switch the loaded model to our padding-free attention (trainer/model/attention.py) when passes are padding-free:
    on CUDA torch's varlen kernel for a bf16 compute dtype, if its self-check passes, else SDPA per sequence.  A model
    whose attention soft-caps its logits or has sinks keeps its own (slower, not wrong)."""
    if padding_free(settings, cuda) and net.config._attn_implementation not in ("flash_attention_2", "flash_attention_3"):
        from trainer.model import attention

        if why := attention.unsupported(net):
            print(f"fulltune: attention: the model's own ({net.config._attn_implementation}): {why}, which fulltune's padding-free attention does not do",
                  flush=True)
            return net
        net.set_attn_implementation(attention.register("cuda" if cuda else "cpu", precision))
    return net


def collator(settings: Settings, tokenizer: Any, cuda: bool) -> Any:
    """TRL's collator in padding-free mode, or None for TRL's default (padded).

    Passed explicitly because TRL 1.16 refuses `padding_free=True` with a `max_length` unless packing is
    on, although its dataset preparation truncates to `max_length` before collation either way.
    """
    if not padding_free(settings, cuda):
        return None
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)


def eval_rows(settings: Settings, rows: Any) -> Any:
    """The validation rows evaluated: all, or the first FT_EVAL_MAX_SAMPLES (the same ones every time)."""
    if rows is None or not settings.eval_max_samples or len(rows) <= settings.eval_max_samples:
        return rows
    return rows.select(range(settings.eval_max_samples))


def fsdp_config(plan: Any) -> dict[str, Any]:
    """FSDP2, every decoder layer its own unit (the model's `_no_split_modules`), parameters resharded after each
    layer's forward, and sharded state dicts: each rank writes its own shard of a checkpoint through torch DCP
    (no gather on rank 0), which any number of FSDP processes can load back (DCP reshards at load time).  The final
    model is gathered once, weights only (trainer/job.py).  Recomputation goes through FSDP's own activation
    checkpointing (transformers' would all-gather every layer twice, #30404)."""
    return {
        "fsdp_version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "reshard_after_forward": True,
        "state_dict_type": "SHARDED_STATE_DICT",
        "activation_checkpointing": plan.checkpointing,
    }


def autocast(precision: Precision, plan: Any) -> bool:
    """bf16 autocast (the Trainer's `bf16`): for bf16-mixed, and for bf16-sr except under FSDP.  bf16-sr's weights are
    bf16 already (autocast changes nothing), and under FSDP accelerate 1.15 upcasts every weight to fp32 when mixed
    precision is on (`fsdp2_prepare_model`): the job would train fp32 weights while the plan counts bf16 ones."""
    return precision.bf16 and not (precision.stochastic_rounding and plan.strategy == "fsdp")


def fsdp_mixed_precision(precision: Precision, plan: Any) -> dict[str, Any] | None:
    """FSDP2's policy under bf16-mixed: layers gathered and computed in bf16, gradients reduce-scattered in fp32 into
    the fp32 master gradients.  accelerate 1.15's own (`set_mixed_precision("bf16")`) also reduces in bf16, which
    rounds every rank's gradient before the sum; one process and DDP sum them in fp32.  None: accelerate's default."""
    if plan.strategy != "fsdp" or not autocast(precision, plan):
        return None
    import torch

    return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.bfloat16}


def hybrid_sharding(plan: Any) -> Any:
    """HSDP for an FSDP plan over several nodes (`plan.replicas`): accelerate's mesh of `dp_replicate` (one per node)
    x `dp_shard` (a node's processes), so each layer's all-gather and reduce-scatter stay within a node.  torchrun numbers
    a node's processes consecutively, which is the mesh's inner dimension.  None: FSDP over every process."""
    if plan.strategy != "fsdp" or plan.replicas == 1:
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=plan.replicas, dp_shard_size=plan.processes // plan.replicas)


def save_steps(settings: Settings, max_steps: int) -> int:
    """FT_SAVE_STEPS, or with `auto` the first multiple of FT_EVAL_STEPS past the last step: the Trainer's own step-based
    saves never come, the job's saver decides at evaluation steps (checkpointing/cadence.py), and the last step saves."""
    if settings.save_steps != "auto":
        return settings.save_steps
    return settings.eval_steps * (max_steps // settings.eval_steps + 1)


def sft_config(settings: Settings, precision: Precision, plan: Any, cuda: bool, evaluate: bool = True, steps: Schedule | None = None) -> Any:
    """`plan` (trainer.model.memory.Plan) gives the passes per step and which layers recompute their activations.

    `steps`: the job's schedule (trainer/core/schedule.py: the steps FT_NUM_EPOCHS makes of the rows, the warm-up of
    FT_WARMUP_RATIO); without one, FT_MAX_STEPS and FT_WARMUP_STEPS as they are.

    `evaluate`: there are validation rows.  Without them (`FT_EVAL_FRACTION=0` and no other validation data)
    nothing is evaluated and the final model is the last step's, not the best by eval loss.
    """
    from trl import SFTConfig

    config = SFTConfig(
        output_dir=Volume(settings.output_dir).checkpoints,
        # -- batch and schedule
        per_device_train_batch_size=plan.sequences_per_pass,
        per_device_eval_batch_size=max(settings.eval_batch_size, plan.sequences_per_pass if settings.batch_layout == "auto" else 1),
        gradient_accumulation_steps=plan.passes_per_step,
        learning_rate=settings.learning_rate,
        lr_scheduler_type=settings.lr_scheduler,
        max_steps=steps.steps if steps else settings.max_steps,  # epochs too: the Trainer counts an epoch as schedule.py does
        warmup_steps=steps.warmup_steps if steps else settings.warmup_steps,
        weight_decay=settings.weight_decay,
        max_grad_norm=settings.max_grad_norm,  # 0 = no clipping (transformers clips only above 0; None breaks its comparison)
        seed=settings.seed,
        data_seed=settings.seed,
        # -- evaluation, checkpoints, best model
        eval_strategy="steps" if evaluate else "no",
        eval_steps=settings.eval_steps,
        save_strategy="steps",
        save_steps=save_steps(settings, steps.steps if steps else settings.max_steps),
        save_total_limit=None,
        logging_steps=settings.logging_steps,
        metric_for_best_model="eval_loss" if evaluate else None,
        greater_is_better=False if evaluate else None,
        load_best_model_at_end=evaluate,
        restore_callback_states_from_checkpoint=settings.early_stopping_patience > 0,  # a resumed job keeps counting evaluations without improvement
        report_to="none",  # tracking.MetricsCallback logs into the job's one run
        # -- data
        # data.prepare() already checked, tokenized, masked (labels -100) and applied FT_MAX_LENGTH/FT_TRUNCATION
        max_length=settings.max_length,
        assistant_only_loss=False,  # the mask is in the labels; TRL would reject the pre-tokenized rows
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
        dataloader_pin_memory=cuda,
        dataloader_num_workers=settings.dataloader_workers,
        dataloader_persistent_workers=settings.dataloader_workers > 0,
        # -- precision, memory and speed
        bf16=autocast(precision, plan),
        fp16=False,
        use_cpu=not cuda,
        activation_checkpointing=plan.checkpointing and plan.strategy != "fsdp",
        activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": plan.checkpoint_every, **({"offload": True} if plan.offload else {})}
        if plan.checkpointing else None,  # offload: the recomputed layers' inputs in pinned host memory (transformers 5.24)
        # -- several processes
        ddp_timeout=settings.collective_timeout_seconds,
        ddp_find_unused_parameters=False,  # every parameter takes part in every forward: no extra autograd traversal
        fsdp=plan.strategy == "fsdp",
        fsdp_config=fsdp_config(plan) if plan.strategy == "fsdp" else None,
        parallelism_config=hybrid_sharding(plan),
        optim=optimizer(settings, cuda),
        torch_compile=settings.compile,
        use_liger_kernel=settings.liger,
        disable_tqdm=True,
    )
    if policy := fsdp_mixed_precision(precision, plan):  # transformers 5.24 has no fsdp_config key for it: the plugin's own argument
        config.fsdp_plugin_args["mixed_precision_policy"] = policy
    return config
