"""One rank of the job's own FSDP trainer on CPU processes, with a precision entrypoint.py refuses on CPU (bf16-mixed),
writing what its prepared model really holds: for tests/test_scale_out.py.

Started by torchrun as the launcher starts `-m trainer` (its command and accelerate's environment from
trainer/launch/launcher.py `torchrun_command`, this script in place of the module).  `FULLTUNE_CONFIG`: the job's
configuration (trainer/core/config.py); `PROBE_OUT`: the folder each rank writes `rank-N.json` to.  It plans, builds
the trainer with trainer/sft_trainer.py `build_trainer` and trains the configured steps; at the first optimizer step it records,
for every FSDP2 module of the wrapped model, its mixed-precision policy, and for every parameter its dtype and mesh.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import TrainerCallback  # noqa: E402

from trainer import sft_trainer  # noqa: E402
from trainer.core import config as job_config  # noqa: E402
from trainer.core import ranks  # noqa: E402
from trainer.data import prepare as data  # noqa: E402
from trainer.model import loading, memory  # noqa: E402


def name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


class Record(TrainerCallback):
    def __init__(self, trainer):
        self.trainer, self.done = trainer, False

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        from torch.distributed.fsdp import FSDPModule

        wrapped = self.trainer.model_wrapped
        policies = sorted({json.dumps({"param_dtype": name(m._get_fsdp_state()._mp_policy.param_dtype),
                                       "reduce_dtype": name(m._get_fsdp_state()._mp_policy.reduce_dtype)})
                           for m in wrapped.modules() if isinstance(m, FSDPModule)})
        params = [p for p in wrapped.parameters()]
        meshes = sorted({json.dumps({"shape": list(p.device_mesh.shape), "dims": list(p.device_mesh.mesh_dim_names or []),
                                     "placements": [str(x) for x in p.placements]}) for p in params if hasattr(p, "device_mesh")})
        record = {
            "rank": int(os.environ["RANK"]),
            "policies": [json.loads(p) for p in policies],
            "params": sorted({f"{type(p).__name__} {name(p.dtype)}" for p in params}),
            "grads": sorted({f"{type(p.grad).__name__} {name(p.grad.dtype)}" for p in params if p.grad is not None}),
            "meshes": [json.loads(m) for m in meshes],
            "parallelism_config": repr(self.trainer.args.parallelism_config),
        }
        Path(os.environ["PROBE_OUT"], f"rank-{record['rank']}.json").write_text(json.dumps(record))


def main() -> None:
    config = job_config.handed_over()
    settings = config.settings
    ranks.start(config)
    tokenizer = loading.load_tokenizer(settings)
    prepared = ranks.main_first(lambda: data.prepare(settings, tokenizer))
    model_config = loading.read_config(settings)
    plan = memory.plan(model_config, loading.parameter_count(model_config), settings, config.precision, 0.0, "off", config.world_size)
    trainer = sft_trainer.build_trainer(config, tokenizer, prepared, plan)
    trainer.add_callback(Record(trainer))
    trainer.train()


if __name__ == "__main__":
    main()
