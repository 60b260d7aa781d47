"""The model's files from the hub, fetched by one process before the others read them.

Every process loads the tokenizer and the weights from FT_MODEL.  With a hub id and several processes, each would
download the same gigabytes into HF_HOME at once: on one node huggingface_hub's per-file lock makes the others wait,
but across nodes sharing HF_HOME on the volume that lock holds only where `flock` works across machines (NFSv4 and
EFS do; Lustre with `localflock` and some FUSE drivers do not), and two writers of one blob can corrupt it.  So rank
0 fetches the files the job loads (`snapshot_download` at FT_MODEL_REVISION, only the files `PATTERNS` names), and
the others start only then: they find them in the cache without asking the hub, or, where their node has a cache of
its own, download them there (the lock holds on one machine: one download per node).
"""

from __future__ import annotations

from typing import Any

from trainer.core import locations, ranks
from trainer.core.settings import Settings
from trainer.model import trust

# What the job reads from a model repo: config.json, generation_config.json, the tokenizer's files, the chat template,
# and safetensors weights (with their index); never the README, images or other formats' weights.
PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


def patterns(settings: Settings) -> list[str]:
    """The files fetched: PATTERNS, plus pickle weights or the model's own code where a setting allows loading them."""
    found = list(PATTERNS)
    if settings.allow_pickle_weights:
        found += [f"*{suffix}" for suffix in trust.PICKLE_SUFFIXES]
    if settings.trust_remote_code:
        found.append("*.py")
    return found


def _download(settings: Settings, local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(settings.model, revision=settings.model_revision or None, allow_patterns=patterns(settings), local_files_only=local_only)


def _from_cache_else_hub(settings: Settings) -> str:
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return _download(settings, local_only=True)  # the cache rank 0 filled (HF_HOME on the shared volume): no request
    except LocalEntryNotFoundError:
        return _download(settings, local_only=False)  # this node's own cache


def model_files(settings: Settings) -> Any:
    """Fetch FT_MODEL's files once (rank 0 first, then the others) when it is a hub id and the hub is online; the
    loaders then read them from the cache."""
    from huggingface_hub import constants

    if not locations.is_hub_id(settings.model) or constants.HF_HUB_OFFLINE:
        return None
    return ranks.main_first(lambda: _download(settings, local_only=False) if ranks.is_main() else _from_cache_else_hub(settings))
