#!/usr/bin/env python3
"""Container entrypoint: validate the FT_* settings, then run the job under accelerate.

    FT_PRESET=demo FT_OUTPUT_DIR=./out python entrypoint.py      # tiny offline demo on CPU
    docker run --gpus 1 -v /data/run1:/output fulltune           # the reference job

Validation runs here, before torch is imported, so a typo exits 2 within a second.  The training
process is a child so that this process (PID 1 in a container) can forward SIGTERM/SIGINT to it and
return its exact exit code (see trainer/launch.py and the README's exit codes).
"""

import os
import sys

from trainer import errors, platforms, settings, volume


def main() -> int:
    platform, implied = platforms.detect(os.environ)
    os.environ.update(implied)  # the training process and the exit path see what the platform implied
    print(platforms.describe(platform, implied), flush=True)
    try:
        config = settings.load(os.environ)
        volume.check_writable(config.output_dir)  # before any model or data is loaded
    except errors.FulltuneError as error:
        return errors.exit_code_for(error)
    from trainer import launch  # imports accelerate (and torch): only after the settings are valid

    return launch.run_under_accelerate(config)


if __name__ == "__main__":
    sys.exit(main())
