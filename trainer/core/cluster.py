"""Several nodes: the FT_* values the cluster's own variables imply (detected like the batch platforms).

Each way of running a multi-node job on Kubernetes tells a pod its place through variables of its own:

  Kubeflow Trainer (TrainJob, torch runtime)  PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
                                              (read by torchrun; `accelerate launch` ignores them, accelerate #3414)
  PyTorchJob (legacy), Volcano                MASTER_ADDR, MASTER_PORT, WORLD_SIZE (pods), RANK (this pod)
  Indexed Job + headless Service              JOB_COMPLETION_INDEX; the manifest sets FT_NUM_NODES and
                                              FT_MASTER_ADDR=<job>-0.<service> (pod host names are stable)

`detect()` turns them into FT_NUM_NODES, FT_NUM_PROCESSES, FT_NODE_RANK, FT_MASTER_ADDR and FT_MASTER_PORT;
`settings.load()` layers them below explicit FT_* variables, which always win.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainer.core.platforms import Implied

KUBEFLOW = {"PET_NNODES": "FT_NUM_NODES", "PET_NPROC_PER_NODE": "FT_NUM_PROCESSES", "PET_NODE_RANK": "FT_NODE_RANK",
            "PET_MASTER_ADDR": "FT_MASTER_ADDR", "PET_MASTER_PORT": "FT_MASTER_PORT"}
PYTORCHJOB = {"WORLD_SIZE": "FT_NUM_NODES", "RANK": "FT_NODE_RANK", "MASTER_ADDR": "FT_MASTER_ADDR", "MASTER_PORT": "FT_MASTER_PORT"}
INDEXED_JOB = {"JOB_COMPLETION_INDEX": "FT_NODE_RANK"}


def detect(environ: Mapping[str, str]) -> tuple[str, Implied]:
    """The cluster launcher's name and the FT_* values it implies ("none", {} when none is found)."""
    for name, variables, marker in (
        ("kubeflow-trainer", KUBEFLOW, "PET_NNODES"),
        ("pytorchjob", PYTORCHJOB, "WORLD_SIZE"),
        ("indexed-job", INDEXED_JOB, "JOB_COMPLETION_INDEX"),
    ):
        if environ.get(marker):
            implied = Implied(marker)
            for variable, setting in variables.items():
                value = environ.get(variable, "")
                if setting == "FT_NUM_PROCESSES" and not value.isdigit():  # "auto", "gpu", "cpu": ours decides (visible GPUs)
                    continue
                implied.offer(environ, setting, value, variable)
            return name, implied
    return "none", Implied("")


def describe(name: str, implied: Implied) -> str | None:
    """The start-up line for a detected cluster launcher, or None."""
    if name == "none":
        return None
    parts = [f"{setting}={value} from {implied.sources[setting]}" for setting, value in implied.items()]
    parts += [f"{setting} set explicitly (kept)" for setting in implied.explicit]
    return f"fulltune: cluster {name} detected by {implied.marker}: " + (", ".join(parts) or "no FT_* values implied")
