"""Rank 0's Prometheus endpoint (`FT_METRICS_PORT`): `GET /metrics` on every address of the pod.

Each scrape reads the job's snapshot (trainer/telemetry/feed.py) as it is at that moment, so the training loop pays
nothing per scrape and nothing per step beyond setting the snapshot's fields.  Names and units follow Prometheus'
conventions (base units, `_total` for counters, `_ratio` for 0 to 1); a value the job does not have yet, or not on
this device (MFU on CPU), is left out rather than shown as 0.  The process' own `process_*` metrics come with them.
The table of names is in docs/deployment.md#metrics.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from trainer.telemetry.feed import REPORTED, SHARES

# The progress line's numbers (trainer/console/progress.py) as gauges: its key, the metric's name and help.
FROM_PROGRESS_LINE = {
    "loss": ("fulltune_loss", "Training loss at the last logging step."),
    "eval_loss": ("fulltune_eval_loss", "Loss on the validation rows at the last evaluation."),
    "lr": ("fulltune_learning_rate", "Learning rate at the last logging step."),
    "tokens_per_s": ("fulltune_tokens_per_second", "Trained (unpadded) tokens per second of optimizer-step time, over the last logging interval."),
    "mfu": ("fulltune_mfu_ratio", "Model FLOPs utilisation over the last logging interval: model FLOPs per second over the GPU's dense bf16 peak."),
}
STAGES = ("starting", *SHARES, "done")


class Collector:
    """The job's metrics, read from `telemetry` at each scrape."""

    def __init__(self, telemetry: Any):
        self.telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        now = self.telemetry.snapshot()
        yield GaugeMetricFamily("fulltune_step", "Optimizer steps done (a resumed job starts at its checkpoint's step).", value=now.step)
        if now.max_steps:
            yield GaugeMetricFamily("fulltune_max_steps", "Optimizer steps the job trains (FT_MAX_STEPS).", value=now.max_steps)
        if now.stage in REPORTED:
            yield GaugeMetricFamily("fulltune_progress_ratio", "The whole job's progress, 0 to 1: the TrainJob's progressPercentage / 100.",
                                    value=now.percentage() / 100)
        stage = GaugeMetricFamily("fulltune_stage", "1 for the stage the job is in: starting, training, saving, evaluating, registering, done.",
                                  labels=["stage"])
        for name in STAGES:
            stage.add_metric([name], 1.0 if now.stage == name else 0.0)
        yield stage
        for key, (name, documentation) in FROM_PROGRESS_LINE.items():
            if key in now.values:  # NaN too: a diverged loss shows as one
                yield GaugeMetricFamily(name, documentation, value=now.values[key])
        if "mem_gb" in now.values:
            memory = GaugeMetricFamily("fulltune_peak_memory_bytes", "Peak memory of the training process: the GPU's allocated peak (device=gpu), "
                                       "or the process' resident peak on CPU (device=host).", labels=["device"])
            memory.add_metric(["gpu" if self.telemetry.cuda else "host"], now.values["mem_gb"] * 1e9)
            yield memory
        remaining = now.remaining_seconds(time.monotonic())
        if remaining is not None:
            yield GaugeMetricFamily("fulltune_estimated_remaining_seconds", "Training's remaining time, as the progress line estimates it.", value=remaining)
        yield CounterMetricFamily("fulltune_checkpoint_blocked_seconds", "Seconds training waited on checkpoint saves (their snapshot; the "
                                  "write runs in the background).", value=now.checkpoint_blocked_total_s)
        yield CounterMetricFamily("fulltune_checkpoints", "Checkpoint saves started by this process.", value=now.checkpoints)
        if now.checkpoints:
            yield GaugeMetricFamily("fulltune_checkpoint_blocked_ratio", "Share of the wall time since training began spent waiting on checkpoint saves.",
                                    value=now.checkpoint_blocked_share)
        idle = now.seconds_since_last_step(time.monotonic())
        if idle is not None:
            yield GaugeMetricFamily("fulltune_seconds_since_last_step", "Seconds since the last optimizer step (since training began, before the first).",
                                    value=idle)
        yield GaugeMetricFamily("fulltune_stuck", "1 while training has gone FT_STUCK_AFTER_SECONDS without an optimizer step.", value=float(now.stuck))
        yield GaugeMetricFamily("fulltune_stuck_after_seconds", "FT_STUCK_AFTER_SECONDS: the stuck signal's threshold; 0 = off.",
                                value=self.telemetry.stuck_after_seconds)


class Endpoint:
    """The HTTP server, from before the first step to the end of the job."""

    def __init__(self, server: Any, port: int):
        self.server, self.port = server, port

    @classmethod
    def serve(cls, port: int, telemetry: Any) -> Endpoint | None:
        """Listen on `port`; one that cannot be had costs one log line, not the job."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(telemetry))
        ProcessCollector(registry=registry)
        try:
            server, _ = start_http_server(port, registry=registry)
        except OSError as error:
            print(f"fulltune: metrics: not served: port {port} (FT_METRICS_PORT): {error.strerror or error}; training goes on", file=sys.stderr, flush=True)
            return None
        print(f"fulltune: metrics: http://0.0.0.0:{port}/metrics (FT_METRICS_PORT)", flush=True)
        return cls(server, port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
