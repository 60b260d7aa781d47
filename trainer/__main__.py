"""`python -m trainer`: the training process (started by entrypoint.py through accelerate)."""

import gc
import sys

from trainer.job import main

gc.freeze()  # the modules just imported live as long as the process: no collection walks them (trainer/core/collector.py)
sys.exit(main())
