"""FSDP2 on CPU processes too, and a log line that shows what each process holds.

accelerate 1.15 decides in `AcceleratorState.__init__` (accelerate/state.py, the `elif self.distributed_type in
[MULTI_GPU, MULTI_MLU, ..., MULTI_NEURON]` branch) that only accelerator process groups honour an FSDP plugin: a
CPU process group stays `MULTI_CPU` and the plugin the Trainer passed is dropped, so the model would be
replicated (DDP) instead of sharded.  Nothing in FSDP2 needs a GPU: `fully_shard` and the full-state-dict
gather run over gloo.  So, when the Trainer's accelerator came out `MULTI_CPU` although the recipe asked for
FSDP, we finish that decision the way accelerate does it for a GPU group: the same plugin (built from the same
`fsdp_plugin_args` the Trainer used), `distributed_type = FSDP` in both shared states.  Everything after that
(wrapping each decoder layer, saving, loading) is accelerate's and transformers' own code path.

Only a CPU process group under FSDP goes through this (`trainer_class`): every GPU job, and every job without
FSDP, is TRL's own SFTTrainer on accelerate's own path.  Checked against accelerate 1.15.0; remove this module's
completion once `AcceleratorState` honours an FSDP plugin on `MULTI_CPU` (tests/test_scale_out.py's FSDP cases
then pass with plain `SFTTrainer`).  The layout a checkpoint was saved in (FSDP or not) is checked in
trainer/checkpointing/layout.py.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from transformers import TrainerCallback

from trainer.core import ranks


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


def trainer_class(cuda: bool, strategy: str) -> type:
    """The job's trainer class: TRL's SFTTrainer whose checkpoint saves the job's saver takes over (in the
    background, trainer/checkpointing/saving.py); under FSDP on CPU processes, one that also completes accelerate's
    decision.  GPU jobs keep accelerate's own FSDP path untouched.  trl is imported only when asked."""
    return _cpu_fsdp_trainer() if strategy == "fsdp" and not cuda else _job_trainer()


@functools.cache  # one class each: `type(trainer) is trainer_class(...)` holds, and each is built once
def _job_trainer() -> type:
    from trl import SFTTrainer

    class JobSFTTrainer(SFTTrainer):
        # transformers 5.24 has no hook to replace how a checkpoint is written (only callbacks after it is): these two
        # private methods are the narrowest place to snapshot the state and write it in the background.
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            """The job's saver (checkpointing/commits.py, a callback with `save_checkpoint`) takes the save over:
            it snapshots the state and writes it in the background."""
            saver = self._checkpoint_saver()
            return saver.save_checkpoint(self, trial) if saver else super()._save_checkpoint(model, trial)

        def train(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().train(*args, **kwargs)
            except BaseException:
                if saver := self._checkpoint_saver():  # the save in flight ends (or fails) before the error leaves: nothing
                    with contextlib.suppress(Exception):  # writes the volume behind a step-down's next attempt or the exit
                        saver.saves.wait()
                raise

        def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
            """DDP's gradients as views into its all-reduce buckets (torch's `gradient_as_bucket_view`): without it the
            reducer keeps flat buckets as large as every gradient beside `param.grad` (16 GB a GPU for Qwen3-4B in fp32),
            which the memory plan does not count.  transformers 5.24 and accelerate 1.15 leave it False, and the Trainer
            builds DDP's kwargs here only (a private method, the narrowest place)."""
            args = super()._build_accelerator_args(**kwargs)
            for handler in args.get("kwargs_handlers", []):
                if hasattr(handler, "gradient_as_bucket_view"):
                    handler.gradient_as_bucket_view = True
            return args

        def _load_best_model(self) -> None:
            if saver := self._checkpoint_saver():
                saver.wait_for_saves()  # the best checkpoint may still be being written
            super()._load_best_model()

        def _checkpoint_saver(self) -> Any:
            return next((cb for cb in self.callback_handler.callbacks if hasattr(cb, "save_checkpoint")), None)

    return JobSFTTrainer


@functools.cache
def _cpu_fsdp_trainer() -> type:
    class ShardedSFTTrainer(_job_trainer()):
        def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
            args = super()._build_accelerator_args(**kwargs)
            self._held_back = args.pop("parallelism_config", None)  # validated against FSDP, which is set only below
            return args

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            honour_fsdp_on_cpu(self, self._held_back)

    return ShardedSFTTrainer


def held_elements(net: Any) -> tuple[int, int]:
    """(parameter elements this process holds, elements of the whole model): FSDP2 parameters are DTensors whose
    local part is this process's shard."""
    held = whole = 0
    for p in net.parameters():
        whole += p.numel()
        held += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return held, whole


class ReportShards(TrainerCallback):
    """Once the model is wrapped (training begins), print what each process holds of it:

    fulltune: fsdp: the model's 445,568 parameter elements, held as 222,848 + 222,720 by 2 processes (largest share 0.500)
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or ranks.world_size() == 1:
            return
        held, whole = held_elements(model)
        counts = ranks.gather(held)
        if ranks.is_main():
            shares = " + ".join(f"{n:,}" for n in counts)
            largest = max(counts) / whole
            held = f"held as {shares} by {len(counts)} processes (largest share {largest:.3f})"
            print(f"fulltune: fsdp: the model's {whole:,} parameter elements, {held}", flush=True)
