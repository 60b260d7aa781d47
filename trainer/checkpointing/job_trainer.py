"""Every job's trainer class: TRL's SFTTrainer whose checkpoint saves the job's saver takes over.

transformers 5.24 has no hook to replace how a checkpoint is written (only callbacks after it is), so the class
overrides the narrowest private methods (docs/architecture.md lists them with their versions, and
tests/test_library_internals.py is their canary): `_save_checkpoint` hands the save to the job's saver
(trainer/checkpointing/commits.py, which snapshots the state and writes it in the background), `_load_best_model`
waits for a save in flight, `_build_accelerator_args` sets DDP's gradient_as_bucket_view.  The saver is given to
the trainer explicitly (`saver=`), not looked for among its callbacks.  Under FSDP on CPU processes a subclass also
completes accelerate's decision (trainer/model/fsdp_on_cpu.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from trainer.model.fsdp_on_cpu import honour_fsdp_on_cpu


def trainer_class(cuda: bool, strategy: str) -> type:
    """The job's trainer class: TRL's SFTTrainer whose checkpoint saves the job's saver takes over (in the
    background, trainer/checkpointing/saving.py); under FSDP on CPU processes, one that also completes accelerate's
    decision.  GPU jobs keep accelerate's own FSDP path untouched.  trl is imported only when asked."""
    return _cpu_fsdp_trainer() if strategy == "fsdp" and not cuda else _job_trainer()


@functools.cache  # one class each: `type(trainer) is trainer_class(...)` holds, and each is built once
def _job_trainer() -> type:
    from trl import SFTTrainer

    class JobSFTTrainer(SFTTrainer):
        def __init__(self, *args: Any, saver: Any = None, **kwargs: Any) -> None:
            """`saver`: the job's CommitCheckpoints (also among the callbacks, for its on_save); None: transformers' own saves."""
            self.saver = saver
            super().__init__(*args, **kwargs)

        # transformers 5.24 has no hook to replace how a checkpoint is written (only callbacks after it is): these two
        # private methods are the narrowest place to snapshot the state and write it in the background.
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            """The job's saver (checkpointing/commits.py, a callback with `save_checkpoint`) takes the save over:
            it snapshots the state and writes it in the background."""
            saver = self.saver
            return saver.save_checkpoint(self, trial) if saver else super()._save_checkpoint(model, trial)

        def train(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().train(*args, **kwargs)
            except BaseException:
                if saver := self.saver:  # the save in flight ends (or fails) before the error leaves: nothing
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
            if saver := self.saver:
                saver.wait_for_saves()  # the best checkpoint may still be being written
            super()._load_best_model()


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
