"""The reference recipe as a TRL `SFTConfig`: the seed notebook's hyperparameters, adapted to today's TRL.

Where we differ from the notebook on purpose:
- precision: fp32 master weights with bf16 autocast instead of bf16 weights updated in place;
- `activation_checkpointing` replaces the deprecated `gradient_checkpointing` name;
- retention is done by checkpoints.CommitCheckpoints (`save_total_limit` is left unset here);
- `report_to="mlflow"` logs into the run tracking.start_run opened (one run per job).
"""

from __future__ import annotations

import os
from typing import Any


def sft_config(settings: Any, precision: str, activation_checkpointing: bool, cuda: bool) -> Any:
    from trl import SFTConfig

    return SFTConfig(
        output_dir=os.path.join(settings.output_dir, "checkpoints"),
        # -- batch and schedule
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.eval_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type=settings.lr_scheduler,
        max_steps=settings.max_steps,
        warmup_steps=settings.warmup_steps,
        weight_decay=settings.weight_decay,
        max_grad_norm=settings.max_grad_norm or None,
        seed=settings.seed,
        data_seed=settings.seed,
        # -- evaluation, checkpoints, best model
        eval_strategy="steps",
        eval_steps=settings.eval_steps,
        save_strategy="steps",
        save_steps=settings.save_steps,
        save_total_limit=None,
        logging_steps=settings.logging_steps,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        load_best_model_at_end=True,
        report_to=["mlflow"],
        # -- data
        # data.prepare() already checked, tokenized, masked (labels -100) and applied FT_MAX_LENGTH/FT_TRUNCATION
        max_length=settings.max_length,
        assistant_only_loss=False,  # the mask is in the labels; TRL would reject the pre-tokenized rows
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
        dataloader_pin_memory=cuda,
        # -- precision and memory
        bf16=precision == "bf16-mixed",
        fp16=False,
        use_cpu=not cuda,
        activation_checkpointing=activation_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if activation_checkpointing else None,
        disable_tqdm=True,
    )
