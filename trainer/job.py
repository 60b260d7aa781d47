"""The job, top to bottom: plan, data, model, train (resuming), save, register."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from trainer import checkpoints, data, demo, memory, model, preemption, progress, recipe, tracking, volume
from trainer import settings as settings_table
from trainer.errors import Preempted, exit_code_for

STATE = ".fulltune"


def run(settings: Any) -> None:
    stopper = preemption.StopOnSignal(settings.stop_deadline_seconds)  # first: a stop during loading is seen
    state_dir = os.path.join(settings.output_dir, STATE)
    final_dir = os.path.join(settings.output_dir, "final")
    run_name = settings.run_name or f"{settings.model.rstrip('/')}_full-fine-tuning"
    status = _read_status(state_dir)
    if status.get("registered") or (status.get("final_model") and not settings.registered_model):
        print(f"fulltune: this job already finished ({status.get('registered') or status['final_model']}): nothing to do", flush=True)
        return
    if status.get("final_model"):  # trained and saved by an earlier attempt whose registration failed (exit 3)
        tracking.configure(settings)
        with tracking.job_run(settings, run_name) as run:
            _register(settings, state_dir, final_dir, run)
        return

    import torch

    cuda = torch.cuda.is_available()
    precision = model.resolve_precision(settings, cuda, cuda and torch.cuda.is_bf16_supported())
    if settings.preset == "demo":
        demo.ensure_demo(settings.output_dir)
    plan = memory.preflight(settings, precision, cuda)  # from config.json alone: exit 2 before weights or data are downloaded
    tokenizer = model.load_tokenizer(settings)
    prepared = data.prepare(settings, tokenizer)  # every row checked and tokenized; exit 2 before anything else is written
    checkpoints.check_fingerprint(settings, state_dir, {"precision": precision})
    _print_plan(settings, precision, len(prepared.train), prepared.eval)
    tracking.configure(settings)
    with tracking.job_run(settings, run_name) as run:
        data.log_report(prepared.report)
        trained = _train(settings, tokenizer, prepared.train, prepared.eval, precision, plan, cuda, stopper)
        metadata = _save_final(settings, trained, tokenizer, final_dir, precision)
        _write_status(state_dir, final_model=final_dir, metadata=metadata)
        print(f"fulltune: final model: {final_dir}/model (transformers) and {final_dir} (MLflow model)", flush=True)
        _register(settings, state_dir, final_dir, run)


def _register(settings, state_dir: str, final_dir: str, run: Any) -> None:
    if not settings.registered_model:
        return
    version = tracking.register(settings, final_dir, _read_status(state_dir)["metadata"])
    _write_status(state_dir, registered=version)
    print(f"fulltune: registered {version} (run {run.info.run_id})", flush=True)


def _train(settings, tokenizer, train_rows, eval_rows, precision, plan, cuda, stopper) -> Any:
    from trl import SFTTrainer

    checkpoint_dir = os.path.join(settings.output_dir, "checkpoints")
    resume = checkpoints.latest_for_resume(checkpoint_dir, os.path.join(settings.output_dir, "incomplete"))
    if stopper.requested:
        raise Preempted("stopped before training started; the committed checkpoints are unchanged")
    net = recipe.prepare_model(model.load_model(settings, tokenizer), settings, cuda)
    args = recipe.sft_config(settings, precision, plan, cuda)
    trainer = SFTTrainer(
        model=net,
        args=args,
        optimizer_cls_and_kwargs=recipe.optimizer_cls_and_kwargs(precision, args),
        data_collator=recipe.collator(settings, tokenizer, cuda),
        train_dataset=train_rows,
        eval_dataset=recipe.eval_rows(settings, eval_rows),
        processing_class=tokenizer,
        callbacks=[checkpoints.CommitCheckpoints(settings.save_total_limit), stopper, progress.Progress(net.config, net.num_parameters(), settings.batch_size * settings.gradient_accumulation_steps, cuda)],
    )
    print(f"fulltune: {'resuming from ' + resume if resume else 'starting from step 0'}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if stopper.requested:
        raise Preempted(f"stopped by signal; checkpoint at step {trainer.state.global_step} committed in {checkpoint_dir}")
    return trainer.model


def _save_final(settings, net, tokenizer, final_dir: str, precision: str) -> dict[str, str]:
    """Save the best model once, as an MLflow transformers model whose `model/` folder is also a
    plain transformers folder (weights + tokenizer), so serving and the registry share one copy."""
    import mlflow
    import torch

    if precision in ("bf16-mixed", "bf16-sr"):
        net = net.to(torch.bfloat16)  # serving weights: half the size of the fp32 master copy (bf16-sr: already bf16)
    n_params = sum(p.numel() for p in net.parameters())
    metadata = {
        "task": "llm/v1/chat",
        "pretrained_model_name": settings.model if settings.preset != "demo" else "fulltune-demo-tiny-qwen3",
        "model_family": model.model_family(net.config),
        "model_size_parameters": model.describe_size(n_params),
        "parameter_count": str(n_params),
    }
    partial = final_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    mlflow.transformers.save_model(
        transformers_model={"model": net, "tokenizer": tokenizer},
        path=partial,
        task="llm/v1/chat",
        metadata=metadata,
        pip_requirements=_serving_requirements(),
    )
    tokenizer.save_pretrained(os.path.join(partial, "model"))
    volume.follow_umask(partial)  # the weights too are readable by a serving pod or a copy job under another uid
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(partial, final_dir)
    mlflow.log_dict(metadata, "model_metadata.json")
    return metadata


def _serving_requirements() -> list[str]:
    """Pin what serving needs; without this, log_model infers extras such as torchvision."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "transformers", "accelerate", "safetensors", "tokenizers")]


def _print_plan(settings, precision, n_train, eval_rows) -> None:
    """What a user would otherwise work out by hand, printed once."""
    effective = settings.batch_size * settings.gradient_accumulation_steps
    print(
        "fulltune: plan\n"
        f"  model {settings.model} ({precision}), data {settings.dataset}: {n_train} train / {len(eval_rows) if eval_rows is not None else 0} validation rows\n"
        f"  {settings.max_steps} steps x effective batch {effective} ({settings.batch_size} x {settings.gradient_accumulation_steps} accumulation)"
        f" = {settings.max_steps * effective} sequences, {settings.max_steps * effective / max(n_train, 1):.2f} epochs,"
        f" up to {effective * settings.max_length} tokens per step\n"
        f"  eval every {settings.eval_steps} steps, checkpoint every {settings.save_steps} steps (keep {settings.save_total_limit} + best)"
        f" in {os.path.join(settings.output_dir, 'checkpoints')}",
        flush=True,
    )


def _read_status(state_dir: str) -> dict:
    path = os.path.join(state_dir, "status.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_status(state_dir: str, **fields: Any) -> None:
    status = _read_status(state_dir) | fields
    os.makedirs(state_dir, exist_ok=True)
    with open(os.path.join(state_dir, "status.json.tmp"), "w", encoding="utf-8") as f:
        json.dump(status, f, indent=1)
    os.replace(os.path.join(state_dir, "status.json.tmp"), os.path.join(state_dir, "status.json"))


def main() -> int:
    """Entry of the training process: run the job and turn its outcome into the documented exit code."""
    try:
        run(settings_table.load(os.environ))
    except BaseException as error:  # noqa: BLE001 - every ending maps to an exit code
        if isinstance(error, SystemExit):
            raise
        if getattr(error, "show_traceback", True):
            import traceback

            traceback.print_exc()
        return exit_code_for(error)
    sys.stdout.flush()
    return 0
