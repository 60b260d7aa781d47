"""Which variables hold secrets: their values are masked wherever fulltune shows a value (errors, the run report,
messages that quote an object store's error)."""

from __future__ import annotations

import re

# TOKEN as a word of the name (HF_TOKEN, MLFLOW_TRACKING_TOKEN; not FT_EVAL_SAMPLE_TOKENS, a count), and the other
# secret words anywhere in it.  docs/settings.md states the same rule.
SECRET_NAME = re.compile(r"(?:^|_)TOKEN(?:_|$)|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CONNECTION_STRING", re.I)
