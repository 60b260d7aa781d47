"""The job's last line, on every ending the training process sees: what happened, in one parseable line.

    fulltune: summary exit=0 wall_s=41.3 steps=40/40 eval_loss=2.5413 samples_right=7/8 model=/data/run1/final/model registered=name/1

Keys without a value are left out (a job that failed before training has no steps and no model); a path
holds no space when the volume's does not.  `wall_s` is this training process's time, start-up included;
the run report's attempts add up every attempt on the volume.  Parse it with trainer.console.progress.parse_line.
"""

from __future__ import annotations

import os
from typing import Any

from trainer.core.volume import Volume
from trainer.evaluation import scoring


def line(code: int, wall_s: float, tracker: Any, output_dir: str | None, max_steps: int | None) -> str:
    """`tracker`: the job's Tracker, or None when the job ended before it had one."""
    values: dict[str, Any] = {"exit": code, "wall_s": f"{wall_s:.1f}"}
    if tracker is not None and tracker.last_step:
        values["steps"] = f"{tracker.last_step}/{max_steps}"
        evals = tracker.history(("eval_loss",)).get("eval_loss")
        if evals:
            values["eval_loss"] = f"{evals[-1][1]:.4f}"
    if output_dir is not None:
        if answers := scoring.last_step(scoring.read_samples(Volume(output_dir).eval_samples)):
            right, answered = scoring.tally(answers)
            values["samples_right"] = f"{right}/{answered}"  # the latest evaluation's sample answers, exactly right
        status = Volume(output_dir).status()
        if status.final_model:
            values["model"] = os.path.abspath(Volume(output_dir).final_model)  # the transformers folder, inside the MLflow model
        if status.registered:
            values["registered"] = status.registered
    return "fulltune: summary " + " ".join(f"{key}={value}" for key, value in values.items())
