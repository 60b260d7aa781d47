"""The MLflow server as the job sees it: whether it answers (at start, during an outage, before registering), and
its URI and errors as the log may show them, without a password.

Asked with a plain GET of `/health` (PROBE_TIMEOUT_SECONDS at most), not through MLflow: a call of MLflow's own
retries for about four minutes before it says the server is gone.  Only http(s) servers are asked; Databricks
and the stores on disk (sqlite, file) are taken to answer.
"""

from __future__ import annotations

import logging
import os
import re

from trainer.core import probe
from trainer.core.errors import TrackingUnreachable
from trainer.tracking.outbox import PROBE_TIMEOUT_SECONDS

CONFIGURED_URI = os.environ.get("MLFLOW_TRACKING_URI", "")  # read once at import: mlflow.set_tracking_uri() exports the variable itself
START_TRIES = 3  # asking the server at start: 3 tries, PROBE_TIMEOUT_SECONDS each, 1 s and 2 s apart


def redact(uri: str) -> str:
    """The URI without user name or password, for logs and the volume."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not (parts.username or parts.password):
        return uri
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=f"****@{host}"))


def scrub(text: str) -> str:
    """`text` with any `//user:password@` in the URLs it quotes masked (MLflow's errors quote the URI it was given)."""
    return re.sub(r"//[^/@\s]+@", "//****@", text)


def gist(text: str) -> str:
    """What a transport error comes down to ("[Errno 111] Connection refused", "Read timed out"), not its screenful."""
    found = re.search(r"\[Errno -?\d+\] [^'\")]+|Read timed out|timed out", text)
    return found.group(0) if found else scrub(text)


class MlflowLogFilter(logging.Filter):
    """MLflow's own log lines: its errors quote the tracking URI with any password in it, so that is masked; and its
    system-metrics thread says once that it stops when the server does not answer, which the outbox's line says."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name.startswith("mlflow.system_metrics") and message.startswith(("Failed to get mlflow run", "Failed to log system metrics")):
            return False
        record.msg, record.args = scrub(message), None
        # its tracebacks (a store on a full volume, a refused call) quote SQL and URIs: the job says what failed in one line
        record.exc_info, record.exc_text = None, None
        return True


def server_uris() -> list[str]:
    """The http(s) servers the job talks to: the tracking server, and the registry's when it is another."""
    uris = [CONFIGURED_URI, os.environ.get("MLFLOW_REGISTRY_URI", "")]
    return list(dict.fromkeys(u for u in uris if u.startswith(("http://", "https://"))))


def _why_not_answering(uri: str) -> str | None:
    """None when the server at `uri` answers (any HTTP status but a proxy's 502/503/504), else why not.

    A GET of /health, at most PROBE_TIMEOUT_SECONDS, without MLflow's retries (they last minutes).  A TLS
    error counts as an answer: something is there, and MLflow's own calls report what is wrong with it.
    """
    import requests

    try:
        response = requests.get(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_SECONDS)
    except requests.exceptions.SSLError:
        return None
    except requests.RequestException as error:
        return f"{type(error).__name__}: {gist(str(error))}"
    return f"HTTP {response.status_code}" if response.status_code in (502, 503, 504) else None


def servers_answer() -> bool:
    """Whether every http(s) server the job uses answers now (databricks and local stores are not asked)."""
    return all(_why_not_answering(uri) is None for uri in server_uris())


def check_reachable() -> None:
    """Raise TrackingUnreachable, within seconds, when MLFLOW_TRACKING_URI is an http(s) server that does not answer.

    Before anything is downloaded: without this the job would load the model and data first, then fail at
    its first MLflow call after MLflow's own retries (about four minutes).  The registry (MLFLOW_REGISTRY_URI)
    is needed only at the end, and waited for then (FT_REGISTRATION_RETRY_SECONDS).
    """
    uri = CONFIGURED_URI
    if not uri.startswith(("http://", "https://")):
        return
    why = probe.answers(lambda: _why_not_answering(uri), START_TRIES)
    if why is None:
        return
    raise TrackingUnreachable(
        f"MLFLOW_TRACKING_URI={redact(uri)}: the MLflow tracking server does not answer ({why}). Nothing was downloaded or written. "
        "Start the server or fix the URI (or unset MLFLOW_TRACKING_URI to track in the store on the volume); a retry helps once it answers."
    )
