"""`python -m trainer`: the training process (started by entrypoint.py through accelerate)."""

import sys

from trainer.job import main

sys.exit(main())
