"""FSDP2 on CPU processes too: accelerate's decision completed for a CPU (gloo) process group.

accelerate 1.15 decides in `AcceleratorState.__init__` (accelerate/state.py, the `elif self.distributed_type in
[MULTI_GPU, MULTI_MLU, ..., MULTI_NEURON]` branch) that only accelerator process groups honour an FSDP plugin: a
CPU process group stays `MULTI_CPU` and the plugin the Trainer passed is dropped, so the model would be
replicated (DDP) instead of sharded.  Nothing in FSDP2 needs a GPU: `fully_shard` and the full-state-dict
gather run over gloo.  So, when the Trainer's accelerator came out `MULTI_CPU` although the recipe asked for
FSDP, we finish that decision the way accelerate does it for a GPU group: the same plugin (built from the same
`fsdp_plugin_args` the Trainer used), `distributed_type = FSDP` in both shared states.  Everything after that
(wrapping each decoder layer, saving, loading) is accelerate's and transformers' own code path.

Only a CPU process group under FSDP goes through this (trainer/checkpointing/job_trainer.py's `trainer_class`):
every GPU job, and every job without FSDP, takes accelerate's own path.  Checked against accelerate 1.15.0; remove this module's
completion once `AcceleratorState` honours an FSDP plugin on `MULTI_CPU` (tests/test_scale_out.py's FSDP cases
then pass with plain `SFTTrainer`).  The layout a checkpoint was saved in (FSDP or not) is checked in
trainer/checkpointing/layout.py.
"""

from __future__ import annotations

from typing import Any


def honour_fsdp_on_cpu(trainer: Any, parallelism: Any = None) -> None:
    """Make the Trainer's accelerator shard with FSDP on a CPU (gloo) process group, as it would on GPUs; with
    `parallelism` (HSDP's ParallelismConfig, which accelerate refuses on a `MULTI_CPU` accelerator and so was held
    back from it), its device mesh too, as `Accelerator.__init__` builds it."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if trainer.args.fsdp_plugin_args is None or state.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # accelerate keeps the process group's own view apart (PartialState's shared dict, private in 1.15.0, no setter);
    # the utilities that ask PartialState() instead of the Accelerator (saving, gathering) must see FSDP too.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True  # transformers derives it from the state right after building the accelerator
    if parallelism is not None:
        state.parallelism_config = parallelism
        state.device_mesh = parallelism.get_device_mesh(trainer.accelerator.device.type)
        parallelism._validate_accelerator(trainer.accelerator)
