"""What the job agrees to load from FT_MODEL: safetensors weights, and no Python code shipped with the model.

Pickle weights (`*.bin`, `*.pt`, ...) are unpickled when loaded, and unpickling can run code hidden in
the file (transformers restricts it with torch's `weights_only`, which has had bypasses).  A config.json
whose `model_type` transformers does not know needs the model's own Python files (`auto_map`) to load.
Both are refused (exit 2) unless a setting opts in, and both are checked in the preflight, from the
folder's (or the hub repo's) file listing and config.json alone, before any weight is read.
"""

from __future__ import annotations

import os
from typing import Any

from trainer.core import locations
from trainer.core.errors import ConfigError
from trainer.core.settings import Settings

SAFE_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
NOT_WEIGHTS = {"training_args.bin"}  # a Trainer checkpoint's pickled arguments: from_pretrained never reads it
SHOWN = 5


def check_model(settings: Settings) -> None:
    """Raise ConfigError when FT_MODEL would load pickle weights or run its own code without the setting that allows it."""
    files = model_files(settings)
    if files is not None:
        check_weights(settings, files)
    check_code(settings)


def model_files(settings: Settings) -> list[str] | None:
    """The file names of FT_MODEL: a local folder, or the hub repo at FT_MODEL_REVISION (None: a hub id that cannot be listed,
    e.g. offline and not cached; loading still takes safetensors only)."""
    if os.path.isdir(settings.model):
        return [os.path.relpath(os.path.join(root, name), settings.model) for root, _, names in os.walk(settings.model) for name in names]
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError

    revision = settings.model_revision or None
    try:
        return HfApi().list_repo_files(settings.model, revision=revision)
    except RevisionNotFoundError as error:
        raise ConfigError(f"FT_MODEL={settings.model!r} has no revision FT_MODEL_REVISION={revision!r} on the hub at {constants.ENDPOINT}") from error
    except RepositoryNotFoundError as error:  # also a gated or private repository without access
        raise ConfigError(
            f"FT_MODEL={settings.model!r}: the hub at {constants.ENDPOINT} has no such model, or it is private or gated and HF_TOKEN has no access to it;"
            f" {locations.not_local(settings.model)}"
        ) from error
    except OfflineModeIsEnabled:
        try:
            folder = snapshot_download(settings.model, revision=revision, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached: model.read_config says so
            return None
        return [os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names]


def check_weights(settings: Settings, files: list[str]) -> None:
    if any(name.endswith(SAFE_SUFFIX) for name in files):
        return  # model.load_model reads only these (use_safetensors=True)
    pickles = sorted(name for name in files if name.endswith(PICKLE_SUFFIXES) and os.path.basename(name) not in NOT_WEIGHTS)
    if pickles and settings.allow_pickle_weights:
        print(f"fulltune: warning: FT_ALLOW_PICKLE_WEIGHTS=true: loading pickle weights {', '.join(pickles[:SHOWN])}", flush=True)
        return
    if pickles:
        shown = ", ".join(pickles[:SHOWN]) + (f" and {len(pickles) - SHOWN} more" if len(pickles) > SHOWN else "")
        raise ConfigError(
            f"FT_MODEL={settings.model!r} has its weights only as pickle files ({shown}), which can run code when loaded; "
            "convert them to safetensors (model.save_pretrained on a trusted machine), or set FT_ALLOW_PICKLE_WEIGHTS=true if you trust their source"
        )
    raise ConfigError(f"FT_MODEL={settings.model!r} has no weights: expected model.safetensors or model.safetensors.index.json with its shards")


def check_code(settings: Settings) -> None:
    """A config.json whose model_type transformers does not have needs the model's own code (`auto_map`): only with FT_TRUST_REMOTE_CODE."""
    raw = _config_dict(settings)
    if raw is None or settings.trust_remote_code:
        return
    from transformers import CONFIG_MAPPING  # the model types built into transformers (a public export since 4.x)

    model_type, auto_map = raw.get("model_type"), raw.get("auto_map") or {}
    if model_type in CONFIG_MAPPING:
        if auto_map:
            print("fulltune: FT_MODEL ships its own code (auto_map); FT_TRUST_REMOTE_CODE is "
                  f"off: using transformers' built-in {model_type!r} instead", flush=True)
        return
    if auto_map:
        code = ", ".join(sorted({str(v[0] if isinstance(v, list | tuple) else v) for v in auto_map.values()}))
        raise ConfigError(
            f"FT_MODEL={settings.model!r}: its model_type {model_type!r} is not built into transformers and needs the Python code shipped with the model "
            f"({code}); fulltune runs no code from a model unless FT_TRUST_REMOTE_CODE=true (read that code first), or use a model transformers supports"
        )


def _config_dict(settings: Settings) -> dict[str, Any] | None:
    """config.json as data (no class is built, no code runs); None when it cannot be read (model.read_config says why)."""
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(settings.model, revision=settings.model_revision or None)
    except (OSError, ValueError):
        return None
    return raw
