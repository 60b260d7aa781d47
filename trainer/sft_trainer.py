"""The job's SFTTrainer, built from a configuration: the model prepared for training, the recipe's arguments, the
checkpoint saver and every callback.  Apart from trainer/job.py because more than the job builds it: bench/ measures
exactly this trainer, and tests train it without running the whole job.
"""

from __future__ import annotations

from typing import Any

from trainer.checkpointing import commits as checkpoints
from trainer.checkpointing import divergence, job_trainer
from trainer.console import progress, quiet, shards
from trainer.core import schedule
from trainer.core.config import Config
from trainer.core.volume import Volume
from trainer.data import prepare as data
from trainer.evaluation import samples
from trainer.model import attention, memory, recipe
from trainer.model import loading as model
from trainer.telemetry.feed import Telemetry
from trainer.tracking.metrics import MetricsCallback
from trainer.tracking.run import Tracker


def build_trainer(
    config: Config, tokenizer: Any, prepared: data.Prepared, plan: memory.Plan, *, tracker: Tracker | None = None, net: Any = None, callbacks: tuple = (),
    telemetry: Telemetry | None = None, after_commit: Any = None, write_seconds: float | None = None,
) -> Any:
    """The job's SFTTrainer for a configuration (bench/ measures exactly this one).

    `tracker`: the job's run (none: a Trainer that tracks nothing); `net`: an already built model instead of
    loading `FT_MODEL` (the GPU benchmark's random-init Qwen3-4B); `telemetry`: what the cluster sees (none: nothing);
    `after_commit(folder)`: told of each committed checkpoint; `write_seconds`: one checkpoint's write as predicted at
    start, which FT_SAVE_STEPS=auto goes by until a write is measured.
    """
    from transformers import EarlyStoppingCallback, PrinterCallback
    from transformers.integrations import KubeflowCallback

    settings, cuda = config.settings, config.cuda
    tracker = tracker or Tracker(config, enabled=False)
    net = recipe.prepare_model(net if net is not None else model.load_model(settings, tokenizer, config.precision), settings, cuda, config.precision)
    if tracker is not None:
        tracker.log(tags={"attention": attention.path_taken(net)})  # which attention trained (the loop, torch's varlen kernel, sdpa)
    quiet.expect_tied_weights(net)  # the best-model reload does not report the tied LM head as missing
    eval_rows = recipe.eval_rows(settings, prepared.eval)
    steps = schedule.of(settings, len(prepared.train), config.world_size)
    args = recipe.sft_config(settings, config.precision, plan, cuda, evaluate=eval_rows is not None, steps=steps)
    sequences_per_step = settings.batch_size * settings.gradient_accumulation_steps
    refuse = divergence.RefuseNonFiniteCheckpoint(Volume(settings.output_dir).incomplete)  # a NaN save never counts
    saver = checkpoints.CommitCheckpoints(settings.save_total_limit, refuse, settings.save_every_minutes, pinned=cuda, after_commit=after_commit,
                                          auto=settings.save_steps == "auto")
    saver.cadence.expected_write = write_seconds
    trainer = job_trainer.trainer_class(cuda, plan.strategy)(  # TRL's SFTTrainer, saving in the background; under FSDP it shards on CPU processes too
        saver=saver,
        model=net,
        args=args,
        optimizer_cls_and_kwargs=recipe.optimizer_cls_and_kwargs(config.precision, args),
        data_collator=recipe.collator(settings, tokenizer, cuda),
        train_dataset=prepared.train,
        eval_dataset=eval_rows,
        processing_class=tokenizer,
        callbacks=[
            saver,
            *callbacks,
            *([shards.ReportShards()] if plan.strategy == "fsdp" else []),
            *samples.callbacks(config, tokenizer, prepared, plan, tracker),
            *([EarlyStoppingCallback(early_stopping_patience=settings.early_stopping_patience)] if settings.early_stopping_patience else []),
            MetricsCallback(tracker),
            progress.Progress(tracker, net.config, net.num_parameters(), sequences_per_step, cuda, saver.costs, telemetry, by_epochs=steps.by_epochs),
            # last: the diverged loss is logged and printed first
            divergence.StopOnDivergence(settings.divergence_patience, settings.loss_limit, settle=saver.wait_for_saves),
        ],
    )
    trainer.remove_callback(PrinterCallback)  # it prints each raw `logs` dict after the progress line (disable_tqdm=True installs it)
    trainer.remove_callback(KubeflowCallback)  # added by TrainingArguments under Kubeflow Trainer; trainer/telemetry/kubeflow.py reports instead
    return trainer
