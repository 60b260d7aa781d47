"""`python -m trainer`: the training process (started by entrypoint.py through accelerate)."""

import sys

from trainer.core import collector
from trainer.job import main

collector.imported()
sys.exit(main())
