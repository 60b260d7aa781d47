"""The final model, saved once on the volume: whole whatever the sharding, in its serving precision, as a plain
transformers folder inside an MLflow model (trainer/tracking/packaging.py), with the metadata the registry gets."""

from __future__ import annotations

import shutil
from typing import Any

from trainer.checkpointing import diskfull
from trainer.core import locations, ranks
from trainer.core.config import Config
from trainer.core.files import staged
from trainer.core.permissions import follow_umask
from trainer.core.volume import Volume
from trainer.model import loading as model
from trainer.tracking import packaging
from trainer.tracking.run import Tracker


def save_final(config: Config, trainer: Any, tokenizer: Any, volume: Volume, tracker: Tracker) -> dict[str, str]:
    """Save the best model once, whole (whatever the sharding was), in its serving precision, as an MLflow
    model (tracking/packaging.py); its metadata goes to the run too.  Rank 0 writes; under FSDP every rank first helps gather it."""
    net = _whole_model(trainer, volume)
    if not ranks.is_main():
        return {}
    net = net.to(config.precision.dtype("serving"))  # bf16 after bf16 training: half the size of the fp32 master copy
    n_params = sum(p.numel() for p in net.parameters())
    settings = config.settings
    metadata = {
        "task": "llm/v1/chat",
        "pretrained_model_name": settings.model if settings.preset != "demo" else "fulltune-demo-tiny-qwen3",
        "model_family": model.model_family(net.config),
        "model_size_parameters": model.describe_size(n_params),
        "parameter_count": str(n_params),
    }
    with diskfull.reported(volume.root, lambda: diskfull.while_saving_final(volume, config.precision.serving_bytes * n_params)):
        with staged(volume.final) as partial:
            served = locations.served_name(settings.registered_model, metadata["pretrained_model_name"])
            packaging.save_model(net, tokenizer, partial, metadata, served_name=served)
            follow_umask(partial)  # the weights too are readable by a serving pod or a copy job under another uid
        volume.mark_saved(metadata)
    tracker.log(artifacts={"model_metadata.json": metadata})
    shutil.rmtree(volume.gathered, ignore_errors=True)
    return metadata


def _whole_model(trainer: Any, volume: Volume) -> Any:
    """The trained model with every weight in one process: as it is, or gathered from its FSDP shards."""
    if not trainer.is_fsdp_enabled:
        return trainer.model
    from transformers import AutoModelForCausalLM

    gathered = volume.gathered
    # Checkpoints are sharded (SHARDED_STATE_DICT), so `save_model` writes no weights under FSDP: this is its
    # FULL_STATE_DICT branch, once, weights only.  Every rank sends its shards; rank 0 holds them (on the host) and writes.
    weights = trainer.accelerator.get_state_dict(trainer.model)
    if ranks.is_main():
        for tied, source in getattr(trainer.model, "all_tied_weights_keys", {}).items():  # gathered as two host copies: keep one
            if source in weights:
                weights.pop(tied, None)
        trainer._save(gathered, state_dict=weights)
    del weights
    ranks.barrier()
    return AutoModelForCausalLM.from_pretrained(gathered) if ranks.is_main() else None
