"""What one job runs with: the settings, parsed once by entrypoint.py, plus what follows from them and the
machine (device, precision), handed to the training process as data.

The training process never reads `FT_*` variables: `trainer/launch/launcher.py` passes this configuration in one variable,
`FULLTUNE_CONFIG` (JSON), so every process of a job (and, later, every rank) runs with exactly what was
validated and logged, even if its environment differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from trainer.core import devices, ending, locations, ranks
from trainer.core import settings as settings_table
from trainer.core.errors import ConfigError
from trainer.core.files import read_json, write_json
from trainer.core.settings import Settings
from trainer.core.volume import Volume

VARIABLE = "FULLTUNE_CONFIG"


@dataclasses.dataclass(frozen=True)
class Precision:
    """How weights are stored and computed, and what that costs per parameter (trainer/model/memory.py, saving)."""

    name: str  # fp32 | bf16-mixed | bf16-sr
    weight_dtype: str  # torch dtype name of the trained weights
    compute_dtype: str  # of the matmuls (autocast)
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq, always fp32
    checkpoint_bytes: int  # weights + AdamW states in a checkpoint (fp32: measured 3.0x the fp32 weights)
    serving_dtype: str  # of the final model's weights: bf16 after bf16 training (half the fp32 master copy)

    @property
    def bf16(self) -> bool:
        return self.compute_dtype == "bfloat16"

    @property
    def autocast_copies(self) -> bool:
        """bf16-mixed: autocast casts each fp32 weight to bf16 while a forward holds it."""
        return self.weight_dtype == "float32" and self.bf16

    @property
    def stochastic_rounding(self) -> bool:
        """bf16 weights updated by trainer/model/optim.py's AdamW with stochastic rounding."""
        return self.weight_dtype == "bfloat16"

    @property
    def training_bytes(self) -> int:
        """Weights, gradients and optimizer states per parameter, before activations."""
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def serving_bytes(self) -> int:
        return 2 if self.serving_dtype == "bfloat16" else 4

    def dtype(self, which: str = "weight") -> Any:
        """The torch dtype of the `weight`s, the `compute` or the `serving` weights."""
        import torch

        return getattr(torch, {"weight": self.weight_dtype, "compute": self.compute_dtype, "serving": self.serving_dtype}[which])


PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp32", "float32", "float32", 4, 4, 8, 12, "float32"),
        Precision("bf16-mixed", "float32", "bfloat16", 4, 4, 8, 12, "bfloat16"),
        Precision("bf16-sr", "bfloat16", "bfloat16", 2, 2, 8, 10, "bfloat16"),
    )
}


def resolve_precision(choice: str, cuda: bool, bf16_supported: bool) -> Precision:
    """FT_PRECISION on this machine.  AdamW states always stay fp32.

    The seed notebook loaded bf16 weights and let AdamW update them in place: at lr 2e-5 most updates
    are below bf16's resolution and are lost.  bf16-mixed keeps fp32 master weights and runs the matmuls
    in bf16 autocast (16 B/param: 64 GB for Qwen3-4B before activations).  bf16-sr keeps bf16 weights and
    gradients and writes each update back with stochastic rounding (trainer/model/optim.py; 12 B/param: 48 GB).
    """
    if choice == "auto":
        return PRECISIONS["bf16-mixed" if cuda and bf16_supported else "fp32"]
    if choice == "bf16-mixed" and not (cuda and bf16_supported):
        raise ConfigError("FT_PRECISION=bf16-mixed needs a GPU with bf16 support; use auto or fp32 on this machine")
    if choice == "bf16-sr" and cuda and not bf16_supported:
        raise ConfigError("FT_PRECISION=bf16-sr needs a GPU with bf16 support; use auto or fp32 on this GPU")
    if choice == "bf16-sr" and not cuda:
        print("fulltune: warning: FT_PRECISION=bf16-sr on CPU: bf16 is several times slower than fp32 there", flush=True)
    return PRECISIONS[choice]


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings and what was derived from them once, where the configuration was built."""

    settings: Settings
    cuda: bool
    precision: Precision
    processes_per_node: int = 1  # FT_NUM_PROCESSES, 0 resolved to the visible GPUs (1 on CPU)

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.settings.num_nodes

    @property
    def run_name(self) -> str:
        return self.settings.run_name or f"{locations.model_name(self.settings.model)}_full-fine-tuning"

    def fingerprint(self) -> dict[str, str]:
        """What the checkpoints on a volume belong to: every setting that changes the result, with the
        precision as resolved on this machine (`auto` means different things on CPU and GPU)."""
        values = settings_table.changing(self.settings, ("data", "training"))
        for resolved_here in ("precision", "num_processes", "num_nodes"):
            del values[resolved_here]
        if values["chat_template"]:  # the file's content renders the rows: an edited file is another configuration
            values["chat_template"] += f" (sha256 {_sha256(values['chat_template'])})"
        # world_size: the global batch grows with the processes
        return {f"FT_{name.upper()}": str(value) for name, value in values.items()} | {"precision": self.precision.name, "world_size": str(self.world_size)}

    def to_json(self) -> str:
        return json.dumps({"settings": dataclasses.asdict(self.settings), "cuda": self.cuda, "precision": self.precision.name,
                           "processes_per_node": self.processes_per_node})

    @classmethod
    def from_json(cls, text: str) -> Config:
        data = json.loads(text)
        return cls(Settings(**data["settings"]), data["cuda"], PRECISIONS[data["precision"]], data["processes_per_node"])


def _sha256(path: str) -> str:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "unreadable"


def strategies(distributed: str, processes: int) -> list[str]:
    """The ways `processes` may share the model under FT_DISTRIBUTED, cheapest first: one process shares nothing,
    `auto` leaves ddp or fsdp to the memory plan (trainer/model/memory.py)."""
    if processes == 1:
        return ["none"]
    return {"auto": ["ddp", "fsdp"], "none": ["ddp"], "ddp": ["ddp"], "fsdp": ["fsdp"]}[distributed]


def sharings(settings: Settings, processes: int) -> list[tuple[str, int]]:
    """(strategy, replicas) to try, cheapest first.  Across nodes FSDP shards within each node and replicates across
    them (HSDP: a layer's all-gather and reduce-scatter stay on the node's NVLink, one all-reduce of the shard's
    gradients crosses nodes) while a node's GPUs hold the model; else it shards over every process."""
    nodes, found = settings.num_nodes, []
    for strategy in strategies(settings.distributed, processes):
        if strategy == "fsdp" and nodes > 1 and processes // nodes > 1:
            found.append((strategy, nodes))
        found.append((strategy, 1))
    return found


def build(settings: Settings, cuda: bool | None = None, bf16_supported: bool | None = None) -> Config:
    """Derive the job's configuration from validated settings; the device is probed unless given (tests)."""
    gpus = 0
    if cuda is None:
        visible = devices.visible()  # the driver's answer: no torch import in entrypoint.py (trainer/core/devices.py)
        cuda, bf16_supported, gpus = visible.cuda, visible.bf16, visible.count
    ending.set_termination_message_path(settings.termination_message_path)
    check_device_levers(settings, cuda)
    processes = settings.num_processes or max(gpus, 1)
    if cuda and gpus and processes > gpus:
        raise ConfigError(f"FT_NUM_PROCESSES={processes}: only {gpus} GPU(s) are visible on this node (one process per GPU)")
    return Config(settings, cuda, resolve_precision(settings.precision, cuda, bool(bf16_supported)), processes)


def check_device_levers(settings: Settings, cuda: bool) -> None:
    """Levers this machine cannot run are exit 2 before anything loads, not an ImportError once training starts."""
    if not settings.liger:
        return
    if not cuda:
        raise ConfigError("FT_LIGER=true needs a GPU (Liger's kernels are Triton kernels); unset it on this machine")
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("FT_LIGER=true needs the liger-kernel package, which this image lacks; "
                          "pip install liger-kernel in a derived image, or unset FT_LIGER")


def handed_over(environ: Mapping[str, str] | None = None) -> Config:
    """The configuration entrypoint.py built, in the training process."""
    environ = os.environ if environ is None else environ
    if VARIABLE not in environ:
        raise ConfigError(f"{VARIABLE} is not set: start the job with entrypoint.py, which validates the FT_* settings and passes them on")
    config = Config.from_json(environ[VARIABLE])
    ending.set_termination_message_path(config.settings.termination_message_path)
    return config


RESOLVED = ("evaluation data",)  # what the training process resolves from the settings and the data (not entrypoint.py)


def check_fingerprint(config: Config, resolved: dict[str, str] | None = None) -> None:
    """Refuse (exit 2) to resume checkpoints written for a different computation, unless allowed.

    The fingerprint holds every setting whose `changes` flag is set (trainer/core/settings.py), so a setting
    that changes the result cannot be forgotten here, and what the settings resolved to (`resolved`, RESOLVED: the
    validation rows' source, which a dataset's splits decide), so that a resume cannot train on another split."""
    settings = config.settings
    path = Volume(settings.output_dir).fingerprint_file
    if read_json(path) is not None:
        if differences := _refuse_other_configuration(config, resolved=resolved):
            print("fulltune: FT_ALLOW_CONFIG_CHANGE=true: resuming despite " + "; ".join(differences), flush=True)
    if ranks.is_main():
        write_json(path, config.fingerprint() | (resolved or {}))


def check_volume(config: Config) -> None:
    """Exit 2 when the volume's checkpoints or finished model were made with other settings; reads, writes nothing.

    entrypoint.py asks this before it starts a training process, so a refused restart takes a second instead of
    the imports, the tokenizer and the data check (minutes on a large dataset) of every process; the training
    process checks again where it records the fingerprint (check_fingerprint, check_finished_job)."""
    if (status := Volume(config.settings.output_dir).status()).final_model or status.registered:
        check_finished_job(config)
    else:
        _refuse_other_configuration(config)


def _refuse_other_configuration(config: Config, recorded: dict[str, str] | None = None, where: str | None = None,
                                resolved: dict[str, str] | None = None) -> list[str]:
    """Exit 2 naming each setting that differs from the volume's (or from `recorded`, the fingerprint kept `where`: the
    mirror, trainer/checkpointing/mirror.py); the differences FT_ALLOW_CONFIG_CHANGE=true allows."""
    settings = config.settings
    if (differences := fingerprint_differences(config, recorded, resolved)) and not settings.allow_config_change:
        raise ConfigError(
            f"the checkpoints in {where or settings.output_dir} belong to a different configuration ("
            + "; ".join(differences)
            + "). Use a new FT_OUTPUT_DIR, restore the settings, or set FT_ALLOW_CONFIG_CHANGE=true to resume anyway."
        )
    return differences


def check_recorded(config: Config, recorded: dict[str, str], where: str) -> list[str]:
    """Exit 2 when the fingerprint kept `where` (the mirror's) is another configuration's; the differences allowed."""
    return _refuse_other_configuration(config, recorded, where)


def fingerprint_differences(config: Config, recorded: dict[str, str] | None = None, resolved: dict[str, str] | None = None) -> list[str]:
    """Each setting that changes the result and differs from what the volume's checkpoints (or final model, or `recorded`:
    a mirror's) were made with; what the settings resolved to (RESOLVED) is compared when the caller knows it (`resolved`)."""
    current, on = config.fingerprint() | (resolved or {}), "on the volume" if recorded is None else "in the mirror"
    recorded = recorded if recorded is not None else read_json(Volume(config.settings.output_dir).fingerprint_file) or {}
    # compared only where both sides know it: entrypoint.py does not, nor a volume or data cache of an earlier version
    unknown = {k for k in RESOLVED if not current.get(k) or k not in recorded}
    return [f"{k}: {recorded.get(k)!r} {on}, {current.get(k)!r} now"
            for k in {**recorded, **current} if recorded and k not in unknown and recorded.get(k) != current.get(k)]


def check_finished_job(config: Config) -> None:
    """Exit 2 when the finished model on the volume was trained with other settings than these, naming each one and the way on."""
    volume = Volume(config.settings.output_dir)
    if differences := fingerprint_differences(config):
        raise ConfigError(
            f"FT_OUTPUT_DIR={volume.root} holds a job that already finished with other settings ({'; '.join(differences)}); nothing was trained."
            f" To train with these settings use a new FT_OUTPUT_DIR; to continue training from the finished model set FT_MODEL={volume.final_model}"
            " and a new FT_OUTPUT_DIR (FT_ALLOW_CONFIG_CHANGE resumes an unfinished job's checkpoints, never a finished one);"
            " to keep the finished model, restore the settings (that re-run is a no-op, exit 0)"
        )
