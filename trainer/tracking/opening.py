"""Open the job's run, from the tracker's background thread: continue the run the volume names, else start one with
the effective configuration as its params; then gather what it must hold before anything new goes in.

    opened = opening.open_run(config, volume, lock)   # Tracker._open_run, off the path to the first step

One job's attempts share one run: the run id is kept on the volume (trainer/tracking/runfile.py), since
transformers' MLflowCallback would start a new run on every restart (transformers #30563).  This is the one place
that creates a run.  The run is driven with MlflowClient and its id, never MLflow's "active run", which belongs to
the thread that started it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from trainer.core import settings as settings_table
from trainer.core.config import Config
from trainer.core.files import read_json
from trainer.core.volume import Volume
from trainer.tracking import delivery, runfile, store
from trainer.tracking.outbox import Outbox
from trainer.tracking.server import gist, redact, servers_answer


@dataclasses.dataclass
class Opened:
    """The open run and what the tracker takes over from it."""

    run_id: str
    facts: dict[str, str]  # the run's id, experiment and redacted tracking URI
    unsent: list[dict[str, Any]]  # what an earlier attempt could not send: it goes first
    recalled: dict[str, list[tuple[int, float]]]  # every metric the run already holds, as (step, value) points
    outbox: Outbox
    monitor: Any  # MLflow's system-metrics monitor, started; None with FT_SYSTEM_METRICS=false


def open_run(config: Config, volume: Volume, lock: threading.Lock) -> Opened:
    """Continue the job's run if the volume names one, else start it and log the effective configuration; `lock`
    guards the run file, which the job's thread writes too."""
    from mlflow import MlflowClient
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking.context.registry import resolve_tags

    settings = config.settings
    experiment_id = store.connect(settings)
    client = MlflowClient()
    run_id = runfile.run_id(volume.run_file)
    run = None
    if run_id:
        try:
            run = client.get_run(run_id)
            client.update_run(run_id, status="RUNNING")
        except MlflowException:
            print(f"fulltune: MLflow run {run_id} named on the volume is not on this server: starting a new run", flush=True)
            run = None
    if run is None:
        run = client.create_run(experiment_id, tags=resolve_tags(), run_name=config.run_name)
        params = settings_table.as_params(settings) | {"precision": config.precision.name}
        client.log_batch(run.info.run_id, params=[Param(key, value) for key, value in params.items()], synchronous=True)
        runfile.update(volume.run_file, lock, run_id=run.info.run_id, tracking_uri=redact(client.tracking_uri))
    monitor = None
    if settings.system_metrics:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor  # what mlflow.start_run starts

        monitor = SystemMetricsMonitor(run.info.run_id, resume_logging=run_id is not None)
        monitor.start()
    try:
        unsent = read_json(volume.unsent_tracking, []) if run_id else []
        recalled = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] for key in sorted(run.data.metrics)}
    except BaseException:
        if monitor is not None:  # the tracker never sees this monitor: stop it here, as the tracker's finish would
            monitor.finish()
        raise
    return Opened(
        run_id=run.info.run_id,
        facts={"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "tracking_uri": redact(client.tracking_uri)},
        unsent=unsent,
        recalled=recalled,
        outbox=Outbox(lambda item: delivery.send(run.info.run_id, item), servers_answer, redact(client.tracking_uri), gist),
        monitor=monitor,
    )
