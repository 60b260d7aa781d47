"""The Hugging Face hub, asked once whether it answers before the job depends on it.

Without this, an unreachable hub (an air-gapped cluster, a proxy down, a wrong HF_ENDPOINT) cost 25 s per
hub id in huggingface_hub's own retries (5, backing off 1-8 s) and ended in a traceback (exit 1).  Now
the job asks the endpoint up to TRIES times (each waits at most HF_HUB_ETAG_TIMEOUT, default 10 s) and,
if nothing answers, exits 1 without a traceback, naming each hub id the settings use and how to run
offline.  Exit 1: a retry helps once the hub answers again.  Any HTTP answer, even an error status,
means the hub is reachable; what it says about the id is left to the libraries' own messages.
"""

from __future__ import annotations

from trainer.core import locations, probe
from trainer.core.errors import HubUnreachable
from trainer.core.settings import Settings

TRIES = 3  # 1 s and 2 s apart (trainer/core/probe.py)


def hub_ids(settings: Settings) -> dict[str, str]:
    """The settings that name something on the hub: FT_MODEL, FT_DATASET, FT_EVAL_DATASET."""
    found = {"FT_MODEL": settings.model} if locations.is_hub_id(settings.model) else {}
    for variable, spec in (("FT_DATASET", settings.dataset), ("FT_EVAL_DATASET", settings.eval_dataset)):
        if spec and locations.is_hub_id(spec, data=True):
            found[variable] = spec
    return found


def check_reachable(settings: Settings) -> None:
    """Raise HubUnreachable when the settings name hub ids, HF_HUB_OFFLINE is off, and the endpoint does not answer."""
    from huggingface_hub import constants

    ids = hub_ids(settings)
    if not ids or (why := unreachable()) is None:
        return
    named = ", ".join(f"{variable}={spec!r}" for variable, spec in ids.items())
    local = "; ".join(locations.not_local(spec) for spec in ids.values())
    raise HubUnreachable(
        f"{named}: the Hugging Face hub at {constants.ENDPOINT} is unreachable ({why}); {local}. To run without it, put the files on the volume and "
        "point the variable at them (FT_MODEL=<folder with config.json and *.safetensors>, FT_DATASET=<files or save_to_disk folder>), "
        "or fill HF_HOME's cache on a connected machine and set HF_HUB_OFFLINE=1. A retry helps once the hub (or HF_ENDPOINT) answers."
    )


def unreachable(tries: int = TRIES) -> str | None:
    """Why the hub's endpoint does not answer (asked up to `tries` times), or None: it answers, or HF_HUB_OFFLINE=1 means it is not asked."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    return probe.answers(lambda: _ask(constants.ENDPOINT, float(constants.HF_HUB_ETAG_TIMEOUT)), tries)


def _ask(endpoint: str, timeout: float) -> str | None:
    """None when the endpoint answers (any HTTP status), else why not."""
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=timeout)
        return None
    except Exception as error:  # noqa: BLE001 - the transport's errors (refused, DNS, timeout, TLS) all mean no answer
        return f"{type(error).__name__}: {error}"
