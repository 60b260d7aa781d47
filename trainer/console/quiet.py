"""What the libraries print into the job's log: only what a user reads about their job.

transformers draws a progress bar at every weight load and checkpoint write, and warns after reloading the best
checkpoint that a tied LM head is missing (it is not: it is saved once, as the input embedding).  Both are
turned off here and nowhere else; hub downloads keep their bars, and any other warning stays.
"""

from __future__ import annotations

import ast
import logging
import os
from typing import Any

RELOAD_LOGGER = "transformers.trainer"


def quiet_libraries(log_level: str) -> None:
    """Keep the job's log to what a user reads (FT_LOG_LEVEL=info): MLflow's INFO lines ("Creating initial MLflow
    database tables...", "Started monitoring system metrics.") are left out, and transformers' bars at every weight
    load and checkpoint write ("Loading weights", "Writing model shards") are off; hub downloads keep theirs.
    FT_LOG_LEVEL=debug keeps both libraries as they are, at INFO."""
    from transformers.utils import logging as transformers_logging

    level = "INFO" if log_level == "debug" else "WARNING"
    os.environ["MLFLOW_LOGGING_LEVEL"] = level  # read when MLflow is first imported (in the tracker's thread)...
    logging.getLogger("mlflow").setLevel(level)  # ...and for an MLflow already imported
    if log_level == "debug":
        transformers_logging.set_verbosity_info()
    else:
        transformers_logging.disable_progress_bar()


class TiedWeightsReload(logging.Filter):
    """The Trainer reloads the best checkpoint non-strictly and reports a tied LM head as missing (it is saved
    once, as the input embedding, and loading that loads both): drop exactly that report, keep any other."""

    PREFIX = "There were missing keys in the checkpoint model loaded: "

    def __init__(self, tied: frozenset[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        try:
            missing = set(ast.literal_eval(message[len(self.PREFIX) :].rstrip(".")))
        except (SyntaxError, ValueError):
            return True
        return not (missing and missing <= self.tied)


def expect_tied_weights(net: Any) -> None:
    """Tell the reload's logger which keys of `net` are tied to another (e.g. Qwen3's lm_head.weight to the embedding);
    the filter of an earlier model, if any, is replaced (one per logger)."""
    params = dict(net.named_parameters(remove_duplicate=False))
    tied = getattr(net, "all_tied_weights_keys", None) or {}
    logger = logging.getLogger(RELOAD_LOGGER)
    for earlier in [f for f in logger.filters if isinstance(f, TiedWeightsReload)]:
        logger.removeFilter(earlier)
    logger.addFilter(TiedWeightsReload(frozenset(k for k, v in tied.items() if k in params and v in params and params[k] is params[v])))
