"""The job, top to bottom: plan, data, model, train (resuming), save, register.

    entrypoint.py (settings parsed once) -> launch.py (accelerate) -> python -m trainer -> main() -> run(config)
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from trainer.checkpointing import commits as checkpoints
from trainer.checkpointing import diskfull, divergence, preemption, saving
from trainer.core import config as job_config
from trainer.core import ranks
from trainer.core.config import Config
from trainer.core.errors import Preempted, exit_code_for, record_exit
from trainer.core.volume import Volume, follow_umask, staged
from trainer.data import demo
from trainer.data import prepare as data
from trainer.model import hub, memory, recipe, sharding
from trainer.model import loading as model
from trainer.tracking import progress, report, samples
from trainer.tracking import run as tracking
from trainer.tracking import server as tracking_server


def run(config: Config) -> None:
    settings = config.settings
    stopper = preemption.StopOnSignal(settings.stop_deadline_seconds)  # first: a stop during loading is seen
    progress.quiet_libraries()
    ranks.start(config)  # several processes: join them, and check they all run this configuration
    volume = Volume(settings.output_dir)
    status = volume.status()
    if done := status.done(registering=bool(settings.registered_model)):
        print(f"fulltune: this job already finished ({done}): nothing to do", flush=True)
        return
    tracking_server.check_reachable()  # seconds, before anything is downloaded, when MLFLOW_TRACKING_URI names a server that does not answer
    if status.final_model:  # trained and saved by an earlier attempt whose registration (or tracking) failed (exit 3)
        if ranks.is_main():
            tracking.configure(settings)
            with tracking.job_run(config):
                _register(config, volume, status.metadata)
        return

    if settings.preset == "demo":
        ranks.main_first(lambda: demo.ensure_demo(settings.output_dir))
    hub.check_reachable(settings)  # seconds, not a traceback after minutes of retries, when the settings need a hub that does not answer
    plan = memory.preflight(config)  # from config.json alone: exit 2 before weights or data are downloaded
    checkpoints.check_sharding(checkpoints.last_committed(volume.checkpoints), plan.strategy)  # before the fingerprint is rewritten
    tokenizer = model.load_tokenizer(settings)
    prepared = ranks.main_first(lambda: data.prepare(settings, tokenizer))  # checked and tokenized once; exit 2 before anything else is written
    checkpoints.check_fingerprint(config)
    _print_plan(config, prepared, plan)
    tracking.configure(settings)
    with tracking.job_run(config):
        tracking.log(**data.tracked(prepared.report))
        run_report = report.RunReport(config, plan, prepared.report)
        trainer = train(config, tokenizer, prepared, plan, stopper, run_report)
        metadata = save_final(config, trainer, tokenizer, volume)
        if ranks.is_main():
            print(f"fulltune: final model: {volume.final_model} (transformers) and {volume.final} (MLflow model)", flush=True)
            try:
                _register(config, volume, metadata)
            finally:
                run_report.finished()  # also after a failed registration (exit 3): it says where the model is


def build_trainer(config: Config, tokenizer: Any, prepared: data.Prepared, plan: memory.Plan, *, net: Any = None, callbacks: tuple = ()) -> Any:
    """The job's SFTTrainer for a configuration (bench/ measures exactly this one).

    `net`: an already built model instead of loading `FT_MODEL` (the GPU benchmark's random-init Qwen3-4B).
    """
    from transformers import EarlyStoppingCallback, PrinterCallback

    settings, cuda = config.settings, config.cuda
    net = recipe.prepare_model(net if net is not None else model.load_model(settings, tokenizer, config.precision), settings, cuda)
    progress.expect_tied_weights(net)  # the best-model reload does not report the tied LM head as missing
    eval_rows = recipe.eval_rows(settings, prepared.eval)
    args = recipe.sft_config(settings, config.precision, plan, cuda, evaluate=eval_rows is not None)
    sequences_per_step = settings.batch_size * settings.gradient_accumulation_steps
    saver = checkpoints.CommitCheckpoints(settings.save_total_limit, Volume(settings.output_dir).incomplete, settings.save_every_minutes, pinned=cuda)
    trainer = sharding.trainer_class()(  # TRL's SFTTrainer; under FSDP it shards on CPU processes too
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
            *([sharding.ReportShards()] if plan.strategy == "fsdp" else []),
            *_sample_answers(config, tokenizer, prepared, plan),
            *([EarlyStoppingCallback(early_stopping_patience=settings.early_stopping_patience)] if settings.early_stopping_patience else []),
            tracking.MetricsCallback(),
            progress.Progress(net.config, net.num_parameters(), sequences_per_step, cuda, saver.costs),
            divergence.StopOnDivergence(settings.divergence_patience, settings.loss_limit),  # last: the diverged loss is logged and printed first
        ],
    )
    trainer.remove_callback(PrinterCallback)  # it prints each raw `logs` dict after the progress line (disable_tqdm=True installs it)
    return trainer


def _sample_answers(config: Config, tokenizer: Any, prepared: data.Prepared, plan: memory.Plan) -> list[Any]:
    """The callback that answers FT_EVAL_SAMPLES validation prompts at step 0 and every evaluation (none under FSDP)."""
    settings = config.settings
    if not settings.eval_samples or prepared.eval is None or plan.strategy == "fsdp":
        return []
    chosen = samples.pick(prepared.eval, settings.eval_samples, settings.seed, tokenizer)
    bf16 = config.cuda and config.precision.bf16
    return [samples.SampleAnswers(tokenizer, chosen, settings.eval_sample_tokens, settings.output_dir, bf16)] if chosen else []


def train(config: Config, tokenizer: Any, prepared: data.Prepared, plan: memory.Plan, stopper: preemption.StopOnSignal, run_report: report.RunReport) -> Any:
    """Train from the newest committed checkpoint (or step 0); return the trainer holding the best model.  A stop
    raises Preempted (on every rank: they agree on the step, trainer/checkpointing/preemption.py) once the run report says so."""
    volume = Volume(config.settings.output_dir)
    # Rank 0 sets cut-short and damaged saves aside (reading the newest back against its checksums); the others then take the newest left.
    resume = ranks.main_first(lambda: checkpoints.latest_for_resume(volume.checkpoints, volume.incomplete, verify=ranks.is_main()))
    if stopper.requested:
        raise Preempted("stopped before training started; the committed checkpoints are unchanged")
    trainer = build_trainer(config, tokenizer, prepared, plan, callbacks=(stopper,))
    trainer.add_callback(run_report)  # last: each evaluation's metrics and sample answers are recorded before it is drawn
    print(f"fulltune: {'resuming from ' + resume if resume else 'starting from step 0'}", flush=True)
    with diskfull.reported(volume.root, lambda: _full_during_training(config, trainer, volume)):
        trainer.train(resume_from_checkpoint=resume)
    if stopper.requested:
        run_report.stopped(trainer.state.global_step)
        raise Preempted(f"stopped by signal; checkpoint at step {trainer.state.global_step} committed in {volume.checkpoints}")
    if trainer.state.global_step < trainer.state.max_steps:
        _stopped_early(config, trainer)
    return trainer


def _full_during_training(config: Config, trainer: Any, volume: Volume) -> tuple[str, int, str]:
    """Exit 6 while training: set the checkpoint cut short aside; it needs about as much as the last committed one."""
    moved = checkpoints.set_aside_uncommitted(volume.checkpoints, volume.incomplete, "volume-full") if ranks.is_main() else []
    last = checkpoints.last_committed(volume.checkpoints)
    needed = checkpoints.committed_bytes(last) or config.precision.checkpoint_bytes * trainer.model.num_parameters()
    saving = f"the checkpoint at step {moved[-1][0]}" if moved else f"the next checkpoint (step {trainer.state.global_step})"
    kept = f"every committed checkpoint, the newest {last}" if last else "nothing yet (no checkpoint was committed: a retry starts from step 0)"
    partial = "".join(f"; the partial checkpoint-{step} is set aside in {where}" for step, where in moved)
    return saving, needed, kept + partial


def _full_elsewhere(volume: Volume) -> tuple[str, int, str]:
    """Exit 6 from any other write (the data cache, the job's state, the embedded MLflow store)."""
    last = checkpoints.last_committed(volume.checkpoints)
    kept = f"every committed checkpoint, the newest {last}" if last else "every file already written (no checkpoint was committed yet)"
    return "a checkpoint of this job", checkpoints.committed_bytes(last), kept


def _stopped_early(config: Config, trainer: Any) -> None:
    """EarlyStoppingCallback ended training before FT_MAX_STEPS: say so in the log and on the run."""
    state, patience = trainer.state, config.settings.early_stopping_patience
    best = os.path.basename(state.best_model_checkpoint or "")
    print(
        f"fulltune: stopped early at step {state.global_step}/{state.max_steps}: eval_loss did not improve for {patience} evaluation(s)"
        f" (FT_EARLY_STOPPING_PATIENCE); best eval_loss={state.best_metric:.4f} at {best}, which becomes the final model",
        flush=True,
    )
    tracking.log(tags={"stopped_early_at_step": str(state.global_step), "best_checkpoint": best})


def save_final(config: Config, trainer: Any, tokenizer: Any, volume: Volume) -> dict[str, str]:
    """Save the best model once, whole (whatever the sharding was), in its serving precision, as an MLflow
    transformers model (tracking.save_model).  Rank 0 writes; under FSDP every rank first helps gather it."""
    net = _whole_model(trainer, volume)
    if not ranks.is_main():
        return {}
    net = net.to(config.precision.dtype("serving"))  # bf16 after bf16 training: half the size of the fp32 master copy
    n_params = sum(p.numel() for p in net.parameters())
    settings = config.settings
    metadata = {
        "task": "llm/v1/chat",
        "pretrained_model_name": settings.model if settings.preset != "demo" else "fulltune-demo-tiny-qwen3",
        "model_family": model.model_family(net.config),
        "model_size_parameters": model.describe_size(n_params),
        "parameter_count": str(n_params),
    }
    with diskfull.reported(volume.root, lambda: _full_during_final_save(config, n_params, volume)):
        with staged(volume.final) as partial:
            tracking.save_model(net, tokenizer, partial, metadata, served_name=_served_name(settings.registered_model, metadata["pretrained_model_name"]))
            follow_umask(partial)  # the weights too are readable by a serving pod or a copy job under another uid
        volume.mark_saved(metadata)
    shutil.rmtree(volume.gathered, ignore_errors=True)
    return metadata


def _served_name(registered: str, base: str) -> str:
    """The name the served model answers with: the registered name, else the base model's hub id (a local base
    model's folder name: a path says nothing to a chat client)."""
    return registered or (os.path.basename(os.path.normpath(base)) if os.path.isdir(base) else base)


def _full_during_final_save(config: Config, n_params: int, volume: Volume) -> tuple[str, int, str]:
    last = checkpoints.last_committed(volume.checkpoints)
    kept = f"every committed checkpoint, the newest {last} (a retry resumes there and saves the final model again)" if last else "no committed checkpoint"
    return "the final model", config.precision.serving_bytes * n_params, f"{kept}; the partial final model {volume.final}.partial is removed by the retry"


def _whole_model(trainer: Any, volume: Volume) -> Any:
    """The trained model with every weight in one process: as it is, or gathered from its FSDP shards."""
    if not trainer.is_fsdp_enabled:
        return trainer.model
    from transformers import AutoModelForCausalLM

    gathered = volume.gathered
    trainer.save_model(gathered)  # every rank sends its shards; rank 0 writes one safetensors folder (FULL_STATE_DICT)
    ranks.barrier()
    return AutoModelForCausalLM.from_pretrained(gathered) if ranks.is_main() else None


def _register(config: Config, volume: Volume, metadata: dict[str, str]) -> None:
    if not config.settings.registered_model or volume.status().registered:  # registered by an attempt whose run could not be finished
        return
    version = tracking.register(config.settings, volume.final, metadata)
    volume.mark_registered(version)
    print(f"fulltune: registered {version}", flush=True)


def _print_plan(config: Config, prepared: data.Prepared, plan: memory.Plan) -> None:
    """What a user would otherwise work out by hand, printed once."""
    settings = config.settings
    per_rank = settings.batch_size * settings.gradient_accumulation_steps
    effective = per_rank * config.world_size
    ranks_line = f" x {config.world_size} processes ({plan.strategy})" if config.world_size > 1 else ""
    by_time = f" or at the first evaluation {settings.save_every_minutes:g} min after the last" if settings.save_every_minutes else ""
    early = f" (stop after {settings.early_stopping_patience} without improvement)" if settings.early_stopping_patience else ""
    n_train, n_eval = len(prepared.train), len(prepared.eval) if prepared.eval is not None else 0
    print(
        "fulltune: plan\n"
        f"  model {settings.model} ({config.precision.name}), data {settings.dataset}: {n_train} train / {n_eval} validation rows\n"
        f"  {settings.max_steps} steps x effective batch {effective} ({settings.batch_size} x {settings.gradient_accumulation_steps} accumulation{ranks_line})"
        f" = {settings.max_steps * effective} sequences, {settings.max_steps * effective / max(n_train, 1):.2f} epochs,"
        f" up to {effective * settings.max_length} tokens per step\n"
        f"  eval every {settings.eval_steps} steps{early}, checkpoint every {settings.save_steps} steps{by_time} (keep {settings.save_total_limit} + best)"
        f" in {Volume(settings.output_dir).checkpoints}\n"
        f"  {_checkpoint_cost(config, plan)}",
        flush=True,
    )


def _checkpoint_cost(config: Config, plan: memory.Plan) -> str:
    """The checkpoint's size and how long the volume takes to write it (measured now: 32 MiB, flushed)."""
    n_params = model.parameter_count(model.read_config(config.settings))
    size = config.precision.checkpoint_bytes * n_params
    staging = memory.checkpoint_staging_bytes(config.precision, n_params, plan.strategy, config.world_size)
    speed = saving.write_speed(Volume(config.settings.output_dir).checkpoints) if ranks.is_main() else None
    write = f"~{size / speed:.1f} s at the volume's measured {speed / 1e9:.2f} GB/s" if speed else "write time unknown (the volume's speed could not be measured)"
    return f"each checkpoint ~{size / 1e9:.2f} GB (weights + AdamW states), written in the background: {write}; host staging {staging / 1e9:.2f} GB per process"


def main() -> int:
    """Entry of the training process: run the job entrypoint.py configured, and turn its outcome into the exit code."""
    if not ranks.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - one progress log per job: rank 0's (errors still reach stderr)
    preemption.end_with_the_launcher()
    try:
        config = job_config.handed_over()
        with diskfull.reported(config.settings.output_dir, lambda: _full_elsewhere(Volume(config.settings.output_dir))):
            run(config)
    except BaseException as error:  # noqa: BLE001 - every ending maps to an exit code
        if isinstance(error, SystemExit):
            raise
        if getattr(error, "show_traceback", True):
            import traceback

            traceback.print_exc()
        code = exit_code_for(error)
        record_exit(code)
        return code
    sys.stdout.flush()
    record_exit(0)
    return 0
