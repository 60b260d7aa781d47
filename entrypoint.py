#!/usr/bin/env python3
"""Container entrypoint: parse and validate the FT_* settings once, then run the job under accelerate.

    FT_PRESET=demo FT_OUTPUT_DIR=./out python entrypoint.py      # tiny offline demo on CPU
    docker run --gpus 1 -v /data/run1:/output fulltune           # the reference job
    FT_MODEL=bench/configs/qwen3-8b python entrypoint.py plan --card h100-80gb [--json]   # the memory plan only
    python entrypoint.py --help                                  # the usage, nothing run

Validation runs here, before torch is imported, so a typo exits 2 within a second; a one-process job never
imports it here (the GPUs come from the NVIDIA driver, trainer/core/devices.py, and the training process adds
accelerate's launch variables itself), which saves ~2 s of every start.  The training
process is a child so that this process (PID 1 in a container) can forward SIGTERM/SIGINT to it and
return its exact exit code; it receives the configuration built here (trainer/core/config.py), not the
environment to parse again (see trainer/launch/launcher.py and the README's exit codes).  This process also holds
the volume's lease for the whole job (trainer/launch/lease.py), so that a second job on the same volume exits 7.
"""

import os
import sys

from trainer.checkpointing import layout
from trainer.core import cluster, config, ending, errors, locations, permissions, platforms, settings
from trainer.launch import launcher as launch
from trainer.launch import lease

USAGE = """usage: python entrypoint.py                                 run the job the FT_* variables describe
       python entrypoint.py plan [--card NAME] [--json]   the memory plan for a card, from config.json alone (plan --help)
       python entrypoint.py --help                          this text

Configured only through environment variables (every FT_* setting and its default: docs/settings.md):
  FT_PRESET=demo FT_OUTPUT_DIR=./out python entrypoint.py   the offline demo on CPU, a few minutes
  FT_MODEL                        a hub id or a local folder (config.json, *.safetensors)
  FT_DATASET                      a hub id, .jsonl/.json/.parquet/.csv files or a folder of them, or an object-store URL
  FT_OUTPUT_DIR                   the volume: checkpoints, the final model, the report (default /output)
  FT_NUM_EPOCHS or FT_MAX_STEPS   how long to train
  HF_TOKEN, MLFLOW_TRACKING_URI   the libraries' own variables
Run it again with the same FT_OUTPUT_DIR and it resumes.  Exit codes (README.md#exit-codes):"""



def main() -> int:
    if sys.argv[1:2] in (["--help"], ["-h"]):  # before anything is read or created
        print(USAGE)
        print("\n".join(f"  {code:>3}  {words}" for code, (words, _) in errors.EXIT_SUMMARY.items()))
        return 0
    if sys.argv[1:2] == ["plan"]:  # a question before renting GPUs: no job, no torch (trainer/model/plan_command.py)
        from trainer.model import plan_command

        return plan_command.main(sys.argv[2:])
    stops = launch.StopForwarder()  # first: a stop during start-up is answered, never lost
    platform, implied = platforms.detect(os.environ)
    print(platforms.describe(platform, implied), flush=True)
    if line := cluster.describe(*cluster.detect(os.environ)):
        print(line, flush=True)
    # Until the settings parse, the termination message goes where the raw variables (or the platform) say.
    ending.set_termination_message_path({**implied, **os.environ}.get("FT_TERMINATION_MESSAGE_PATH", ending.DEFAULT_TERMINATION_LOG))
    try:
        validated = settings.load(os.environ)
        locations.check(validated, before_the_preset=True)  # a local FT_MODEL or FT_DATASET that does not exist: exit 2 before torch loads
        permissions.check_writable(validated.output_dir)  # in a second, before any model or data is loaded
        # Exit 7 while another job runs on this volume, before anything is written to it; released however the job ends.
        with lease.held(validated, stopping=lambda: bool(stops.received), on_lost=stops.end_now):
            job = config.build(validated)  # the GPUs, as the driver shows them (no torch here: trainer/core/devices.py)
            config.check_volume(job)  # a restart with other settings than the volume's: exit 2 before any process starts
            layout.check_readable(job)  # a checkpoint this job's sharing (one process, ddp, fsdp) cannot read: exit 2 as well
            return launch.run_under_accelerate(job, stops)
    except errors.FulltuneError as error:
        return ending.exit_code_for(error)


if __name__ == "__main__":
    sys.exit(main())
