"""The job, top to bottom: plan, data, model, train (resuming), save, evaluate, register.

    entrypoint.py (settings parsed once) -> launch/launcher.py (accelerate) -> python -m trainer -> main() -> run(config)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from trainer import sft_trainer
from trainer.checkpointing import commits as checkpoints
from trainer.checkpointing import diskfull, layout, manifest, preemption, restore, uploads
from trainer.console import overview, quiet, summary
from trainer.core import collector, devices, locations, ranks, schedule
from trainer.core import config as job_config
from trainer.core import settings as settings_table
from trainer.core.config import Config
from trainer.core.ending import exit_code_for, record_exit
from trainer.core.errors import Preempted, StepDownRestart, StopAbandoned
from trainer.core.volume import Volume
from trainer.data import data_report, demo
from trainer.data import prepare as data
from trainer.evaluation import compare, scoring
from trainer.evaluation import stage as evaluation
from trainer.evaluation import tasks as eval_tasks
from trainer.launch import launcher
from trainer.model import fetch, hub, memory, step_cost, stepdown
from trainer.model import loading as model
from trainer.publishing import copies, final_model, hub_push
from trainer.report import report
from trainer.telemetry.feed import Telemetry
from trainer.tracking import server as tracking_server
from trainer.tracking.run import Tracker

STARTED = time.perf_counter()  # the training process's start, for the summary line and FT_LOG_LEVEL=debug's timings


def run(config: Config, tracker: Tracker, telemetry: Telemetry) -> None:
    settings = config.settings
    stopper = preemption.StopOnSignal(settings.stop_deadline_seconds)  # first: a stop during loading is seen
    quiet.quiet_libraries(settings.log_level)
    _debug(settings, "imported")
    ranks.start(config)  # several processes: join them, and check they all run this configuration
    volume = Volume(settings.output_dir)
    status = volume.status()
    if status.final_model or status.registered:
        job_config.check_finished_job(config)  # a finished volume re-run with other settings trains nothing: say so (exit 2), never exit 0
    if done := status.done(registering=bool(settings.registered_model), mirror=copies.mirror_name(settings), hub=settings.push_to_hub):
        print(f"fulltune: this job already finished ({done}): nothing to do", flush=True)
        return
    tracking_server.check_reachable()  # seconds, before anything is downloaded, when MLFLOW_TRACKING_URI names a server that does not answer
    tracker.warm_up()  # MLflow imported and the URI checked in the background, while the plan and the data are checked
    if status.final_model:  # saved by an earlier attempt stopped while evaluating (75), or whose gate (9), registration (3) or delivery (8) failed
        if ranks.is_main():
            refused = None
            with tracker:
                try:
                    refused = _evaluate_and_register(config, volume, status.metadata, tracker, telemetry, stopper)
                finally:  # the page the training attempt wrote, with the evaluation's table and how it ended
                    report.RunReport.refresh_after_evaluation(volume, tracker, str(refused) if refused else None)
            copies.deliver(config, volume, None)
            if refused:
                raise refused
        return

    benchmarks, plan, mirror, tokenizer, prepared = before_training(config, volume)
    if ranks.is_main():
        evaluation.keep_rows(config, prepared.eval, tokenizer)  # the rows the evaluation stage scores, chosen before training
    mirroring = uploads.Uploads(mirror, volume, settings.save_total_limit) if mirror else None
    if mirroring:
        mirroring.committed()  # the fingerprint, and what an earlier attempt committed but did not upload
    steps = schedule.of(settings, len(prepared.train), config.world_size)  # FT_MAX_STEPS or FT_NUM_EPOCHS, now that the rows are known
    tracker.planned_steps = steps.steps
    write_seconds = overview.print_plan(config, prepared, plan, steps)  # one checkpoint's write on this volume, as its speed measured now predicts
    stopper.know_the_save(write_seconds, volume.checkpoints)  # a stop that cannot save in time says so
    _debug(settings, "data checked")
    tracker.start()  # exit 2 here for a tracking URI MLflow cannot use; the store and the run open in the background
    with tracker:
        tracker.log(**data_report.tracked(prepared.report))
        run_report = report.RunReport(_report_facts(config, plan, prepared, steps), tracker, committed=lambda: _committed(volume))
        try:
            trainer = train(config, tokenizer, prepared, plan, stopper, run_report, tracker, telemetry, mirroring, write_seconds)
        except (Preempted, StopAbandoned):  # the mirror gets what is left of the stop's deadline for what it still owes
            uploads.after_stop(mirroring, stopper)
            raise
        telemetry.stage("saving")
        metadata = final_model.save_final(config, trainer, tokenizer, volume, tracker)
        state = trainer.state
        evaluation.free_training_memory(trainer)
        del trainer
        evaluation.empty_device()  # the GPU's memory back before the evaluation stage loads its models
        refused = None
        if ranks.is_main():
            print(f"fulltune: final model: {volume.final_model} (transformers) and {volume.final} (MLflow model)", flush=True)
            if settings.push_to_hub:
                hub_push.write_card(config, volume, metadata, tracker, state)
            if mirroring:
                mirroring.final()  # uploaded while the model is evaluated and registered
            try:
                refused = _evaluate_and_register(config, volume, metadata, tracker, telemetry, stopper, benchmarks)
            finally:
                run_report.finished(refused=str(refused) if refused else None)  # also after a failed registration (exit 3): it says where the model is
                if line := scoring.said_at_the_end(volume.eval_samples, volume.report):
                    print(line, flush=True)
    copies.deliver(config, volume, mirroring)  # FT_MIRROR_URL holds it all (exit 8 past FT_MIRROR_WAIT_SECONDS), then FT_PUSH_TO_HUB
    if refused:
        raise refused  # exit 9, once the copies hold the saved model too


def before_training(config: Config, volume: Volume) -> tuple[eval_tasks.Benchmarks | None, memory.Plan, restore.Mirror | None, Any, data.Prepared]:
    """Every check before the trainer is built, cheapest first, then the tokenizer and the checked, tokenized data: the
    benchmarks (rank 0), the plan, the mirror, the tokenizer, the data.  tests/test_documented_values.py builds from it too."""
    settings = config.settings
    if settings.preset == "demo":
        ranks.main_first(lambda: demo.ensure_demo(settings.output_dir))
    locations.check(settings)  # exit 2 for a local FT_MODEL/FT_DATASET that does not exist, before it could be taken for a hub id
    benchmarks = ranks.main_first(lambda: eval_tasks.resolve(settings.eval_tasks) if ranks.is_main() else None)  # an unknown task: exit 2 now
    hub.check_reachable(settings)  # seconds, not a traceback after minutes of retries, when the settings need a hub that does not answer
    hub_push.check_token(settings)  # FT_PUSH_TO_HUB without a token: exit 2 now, not after training
    # From config.json alone: exit 2 before weights or data are downloaded.  Rank 0 first: it alone fetches config.json from the hub.
    planned = ranks.main_first(lambda: memory.preflight(config))
    mirror = ranks.main_first(lambda: restore.from_mirror(config, volume))  # FT_MIRROR_URL: its newest checkpoint, when newer than the volume's
    layout.check_resumable(manifest.last_committed(volume.checkpoints), planned.strategy)  # before the fingerprint is rewritten
    fetch.model_files(settings)  # a hub model's files, downloaded by rank 0 before any other process reads them
    tokenizer = model.load_tokenizer(settings)
    prepared = ranks.main_first(lambda: data.prepare(settings, tokenizer))  # checked and tokenized once; exit 2 before anything else is written
    # the layouts ranked again for the data's mean sequence, then the smaller plan an earlier attempt stepped down to, if any
    plan = stepdown.resumed(config, memory.for_data(config, planned, step_cost.mean_tokens_of(prepared.report)))
    job_config.check_fingerprint(config, {"evaluation data": prepared.report.get("eval_source", "")})  # a resume validates on the same rows
    return benchmarks, plan, mirror, tokenizer, prepared


def _evaluate_and_register(config: Config, volume: Volume, metadata: dict[str, str], tracker: Tracker, telemetry: Telemetry,
                           stopper: preemption.StopOnSignal, benchmarks: eval_tasks.Benchmarks | None = None) -> Exception | None:
    """Rank 0, the final model saved: the evaluation stage (resumed where an earlier attempt stopped), its gate, then the
    registration; return the gate's refusal (RegressionFound, exit 9) instead of registering."""
    stopper.nothing_left_to_save("during the evaluation stage: the scores done are kept on the volume; a retry evaluates the rest, without training")
    summary = evaluation.run(config, tracker, telemetry, benchmarks)
    if config.settings.push_to_hub and summary:
        hub_push.add_evaluation(volume, compare.description(summary))
    if refused := evaluation.gate(config, summary):
        print(f"fulltune: not registered: {refused}", flush=True)
        return refused
    if config.settings.registered_model:
        telemetry.stage("registering")
    _register(config, volume, metadata, tracker, summary)
    return None


def _report_facts(config: Config, plan: memory.Plan, prepared: data.Prepared, steps: schedule.Schedule) -> report.ReportFacts:
    settings = config.settings
    return report.ReportFacts(
        title=config.run_name,
        model=settings.model,
        data=settings.dataset,
        precision=config.precision.name,
        max_steps=steps.steps,
        output_dir=settings.output_dir,
        plan={"peak": plan.peak, "breakdown": plan.breakdown, "described": plan.describe(), "cuda": config.cuda},
        data_report=data_report.report_text(prepared.report),
        hyperparameters=settings_table.as_params(settings),
    )


def _committed(volume: Volume) -> list[str]:
    return [os.path.basename(path) for _, path in manifest.committed(volume.checkpoints)]


def _debug(settings: Any, stage: str) -> None:
    """FT_LOG_LEVEL=debug: when each start-up stage ended, in seconds since the training process started (bench/startup.py)."""
    if settings.log_level == "debug":
        print(f"fulltune: debug: start-up: {stage} at {time.perf_counter() - STARTED:.2f} s", flush=True)


def train(
    config: Config, tokenizer: Any, prepared: data.Prepared, plan: memory.Plan, stopper: preemption.StopOnSignal, run_report: report.RunReport,
    tracker: Tracker, telemetry: Telemetry, mirroring: uploads.Uploads | None = None, write_seconds: float | None = None,
) -> Any:
    """Train from the newest committed checkpoint (or step 0); return the trainer holding the best model.  A stop
    raises Preempted (on every rank: they agree on the step, trainer/checkpointing/preemption.py) once the run report says so."""
    volume = Volume(config.settings.output_dir)

    def attempt(plan: memory.Plan, watch: Any) -> Any:
        # Rank 0 sets cut-short and damaged saves aside (reading the newest back against its checksums); the others then take the newest left.
        resume = ranks.main_first(lambda: checkpoints.latest_for_resume(volume.checkpoints, volume.incomplete, verify=ranks.is_main()))
        stopper.begin_training()  # a stop that came while the job started ends it here, 76
        trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan, tracker=tracker, callbacks=(stopper, watch), telemetry=telemetry,
                                            after_commit=mirroring.committed if mirroring else None, write_seconds=write_seconds)
        trainer.add_callback(run_report)  # last: each evaluation's metrics and sample answers are recorded before it is drawn
        stopper.saves = trainer.saver.saves  # a stop can commit the save in flight instead of starting another
        tracker.began_training(int(resume.rsplit("-", 1)[1]) if resume else 0, started=time.time() - (time.perf_counter() - STARTED))
        print(f"fulltune: {'resuming from ' + resume if resume else 'starting from step 0'}", flush=True)
        estimate = config.precision.checkpoint_bytes * trainer.model.num_parameters()  # until a checkpoint says how big one is
        with diskfull.reported(volume.root, lambda: diskfull.while_training(volume, trainer.state.global_step, estimate)), collector.frozen():
            trainer.train(resume_from_checkpoint=resume)
        return trainer

    trainer = stepdown.Ladder(config, plan).run(attempt)  # out of memory: the next plan down, from the last committed checkpoint
    if stopper.requested:
        tracker.ended_training(f"stopped by a signal at step {trainer.state.global_step} (exit 75)")
        run_report.stopped(trainer.state.global_step)
        raise Preempted(f"stopped by signal; checkpoint at step {trainer.state.global_step} committed in {volume.checkpoints}")
    if trainer.state.global_step < trainer.state.max_steps:
        _stopped_early(config, trainer, tracker)
    tracker.ended_training(f"finished at step {trainer.state.global_step}")
    return trainer


def _stopped_early(config: Config, trainer: Any, tracker: Tracker) -> None:
    """EarlyStoppingCallback ended training before FT_MAX_STEPS: say so in the log and on the run."""
    state, patience = trainer.state, config.settings.early_stopping_patience
    best = os.path.basename(state.best_model_checkpoint or "")
    print(
        f"fulltune: stopped early at step {state.global_step}/{state.max_steps}: eval_loss did not improve for {patience} evaluation(s)"
        f" (FT_EARLY_STOPPING_PATIENCE); best eval_loss={state.best_metric:.4f} at {best}, which becomes the final model",
        flush=True,
    )
    tracker.log(tags={"stopped_early_at_step": str(state.global_step), "best_checkpoint": best})


def _register(config: Config, volume: Volume, metadata: dict[str, str], tracker: Tracker, summary: dict | None = None) -> None:
    """The final model as a new version of FT_REGISTERED_MODEL, its evaluation (when there was one) in its tags and description."""
    if not config.settings.registered_model or volume.status().registered:  # registered by an attempt whose run could not be finished
        return
    from trainer.evaluation import compare

    version = tracker.register(volume.final, metadata | (compare.tags(summary) if summary else {}), compare.description(summary) if summary else "")
    volume.mark_registered(version)
    print(f"fulltune: registered {version}", flush=True)


def main() -> int:
    """Entry of the training process: run the job entrypoint.py configured, and turn its outcome into the exit code."""
    if not ranks.is_main():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - one progress log per job: rank 0's (errors still reach stderr)
    preemption.end_with_the_launcher()
    config = tracker = None
    telemetry = Telemetry()
    stepped_down = False
    try:
        config = job_config.handed_over()
        telemetry = Telemetry.start(config)  # the metrics endpoint and the TrainJob status, from before the first step
        if ranks.world_size() == 1:  # torchrun's ranks got accelerate's environment from the launcher
            os.environ.update(launcher.accelerate_environment(use_cpu=not config.cuda))
        devices.check_torch_agrees(config.cuda)
        tracker = Tracker(config)
        with diskfull.reported(config.settings.output_dir, lambda: diskfull.elsewhere(Volume(config.settings.output_dir))):
            run(config, tracker, telemetry)
        ranks.end_together()  # the other ranks stay until rank 0 has saved and registered the model
        code = 0
    except BaseException as error:  # noqa: BLE001 - every ending maps to an exit code
        if isinstance(error, SystemExit):
            raise
        if getattr(error, "show_traceback", True):
            import traceback

            traceback.print_exc()
        code = exit_code_for(error)
        stepped_down = isinstance(error, StepDownRestart) and ranks.world_size() > 1
    if ranks.is_main() and config is not None:
        settings = config.settings
        print(summary.line(code, time.perf_counter() - STARTED, tracker, settings.output_dir, tracker.planned_steps if tracker else None), flush=True)
    telemetry.close(code)  # 100 % only here, for exit 0: trained, saved and registered
    if code == 0:
        ranks.leave()  # every collective has completed: the process group is destroyed, not left to the interpreter's exit
    sys.stdout.flush()
    record_exit(code)
    collector.finished()
    if stepped_down:
        # The next plan is recorded and so is this code: nothing is left to do.  The other ranks may be held in a collective
        # and NCCL work still in flight, which the interpreter's teardown of the process group would wait for; the
        # launcher ends them (trainer/launch/launcher.py) and starts every rank again at the recorded plan.
        sys.stderr.flush()
        os._exit(code)
    return code
