"""The output volume (`FT_OUTPUT_DIR`): every path fulltune writes there, how it writes them, and the job's status.

    volume = Volume(settings.output_dir)
    volume.checkpoints            # checkpoints/checkpoint-N/ (what counts as committed: checkpoints.py)
    write_json(volume.status_file, {...})   # never a half-written file, whatever kills the process
    with staged(volume.final) as partial:   # never a half-written folder: built aside, then renamed into place
        ...

The README's "What lands on the volume" table lists the same paths.  Nothing else in the package joins
paths under `FT_OUTPUT_DIR`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from trainer.core.errors import ConfigError


class Volume:
    """The layout of one job's output folder."""

    def __init__(self, root: str):
        self.root = root

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def checkpoints(self) -> str:
        """Committed checkpoints, `checkpoint-N/` each (TrainingArguments.output_dir)."""
        return self._path("checkpoints")

    @property
    def incomplete(self) -> str:
        """Checkpoints whose save was cut short, set aside at the next start."""
        return self._path("incomplete")

    @property
    def final(self) -> str:
        """The final model as an MLflow transformers model."""
        return self._path("final")

    @property
    def final_model(self) -> str:
        """The same weights and tokenizer as a plain transformers folder (inside `final`)."""
        return self._path("final", "model")

    @property
    def gathered(self) -> str:
        """Several processes under FSDP: the whole model gathered from its shards, before it becomes `final`."""
        return self._path("final.gathered")

    @property
    def mlflow_store(self) -> str:
        """The embedded MLflow store (SQLite + artifacts) when no tracking server is set."""
        return self._path("mlflow")

    @property
    def data_report(self) -> str:
        return self._path("data-report.txt")

    @property
    def eval_samples(self) -> str:
        """The sample answers: one JSON line per prompt, at step 0 and at every evaluation (trainer/tracking/samples.py)."""
        return self._path("eval-samples.jsonl")

    @property
    def report(self) -> str:
        """The run report: one HTML page with its charts inside, refreshed at every evaluation (trainer/tracking/report.py)."""
        return self._path("report.html")

    @property
    def demo(self) -> str:
        """FT_PRESET=demo: the tiny model, tokenizer and data."""
        return self._path("demo")

    @property
    def state(self) -> str:
        """Job state: status, fingerprint, MLflow run id, the running job's lease, tokenized-data cache."""
        return self._path(".fulltune")

    @property
    def status_file(self) -> str:
        return self._path(".fulltune", "status.json")

    @property
    def fingerprint_file(self) -> str:
        return self._path(".fulltune", "fingerprint.json")

    @property
    def run_file(self) -> str:
        return self._path(".fulltune", "mlflow_run.json")

    @property
    def lease_file(self) -> str:
        """Which job is writing this volume now (trainer/launch/lease.py); absent when none is."""
        return self._path(".fulltune", "lease.json")

    @property
    def lease_lock(self) -> str:
        """Held for the few milliseconds in which a job takes, refreshes or releases the lease."""
        return self._path(".fulltune", "lease.lock")

    @property
    def unsent_tracking(self) -> str:
        """What the tracking server did not answer for before an attempt ended: the next attempt sends it first."""
        return self._path(".fulltune", "unsent-tracking.json")

    @property
    def memory_plan_file(self) -> str:
        """The plan an out-of-memory step-down settled on, with the peaks measured (trainer/model/stepdown.py): a restart starts there."""
        return self._path(".fulltune", "memory-plan.json")

    @property
    def data_cache(self) -> str:
        return self._path(".fulltune", "data-cache")

    # -- The job's status: trained and saved, then registered ---------------------------------------

    def status(self) -> Status:
        return Status(**read_json(self.status_file, {}), unsent_tracking=os.path.exists(self.unsent_tracking))

    def mark_saved(self, metadata: dict[str, str]) -> None:
        """The final model is complete on the volume: a restart skips training (exit 3 retries register only)."""
        write_json(self.status_file, {"final_model": self.final, "metadata": metadata})

    def mark_registered(self, version: str) -> None:
        write_json(self.status_file, read_json(self.status_file, {}) | {"registered": version})


class Status:
    """What earlier attempts of this job finished: nothing, the final model, or the registration too."""

    def __init__(self, final_model: str | None = None, metadata: dict[str, str] | None = None, registered: str | None = None, unsent_tracking: bool = False):
        self.final_model, self.metadata, self.registered = final_model, metadata or {}, registered
        self.unsent_tracking = unsent_tracking  # metrics the tracking server never got: the job is not done until it has them

    def done(self, registering: bool) -> str | None:
        """What the finished job left (a registered version or the model folder), or None if work remains."""
        if self.unsent_tracking:
            return None
        if self.registered:
            return self.registered
        return self.final_model if self.final_model and not registering else None


def read_json(path: str, default: Any = None) -> Any:
    if not os.path.exists(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, value: Any) -> None:
    write_text(path, json.dumps(value, indent=1, ensure_ascii=False))


def write_text(path: str, text: str) -> None:
    """Write to a temporary file, flush it to disk, then rename it over `path`: readers see the old or the new."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".tmp"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


@contextlib.contextmanager
def staged(target: str) -> Iterator[str]:
    """Yield `<target>.partial` to fill; on success it replaces `target`, on failure it is left for the next try.

    A folder, unlike a file, cannot be renamed over an existing one, so the old `target` is removed just
    before the rename: a crash between the two leaves `.partial` complete, and the next attempt redoes it.
    """
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(os.path.dirname(partial) or ".", exist_ok=True)
    yield partial
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)


# -- Who can write the volume, and who can read what the job wrote ----------------------------------
# The volume usually outlives the job and is read by someone else: a serving pod, a notebook or a copy
# job that runs under another uid on the same PersistentVolumeClaim.


def check_writable(output_dir: str) -> None:
    """Fail in a second (exit 2) when the job's user cannot write FT_OUTPUT_DIR, naming the fix.

    The usual cause is a volume owned by root or by the host user while the image runs as uid 10001;
    without this check the job would load the model and data first and fail at its first write.
    """
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fulltune-write-check-", dir=output_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        uid, gid = os.getuid(), os.getgid()
        raise ConfigError(
            f"FT_OUTPUT_DIR={output_dir} is not writable by this process (uid {uid}, gid {gid}): {error.strerror}. "
            f"Give uid {uid} write access to the volume: on Kubernetes set the pod's securityContext.fsGroup (e.g. fsGroup: {gid}); "
            f"with docker run, mount a folder owned by uid {uid} (`chown {uid}:{gid} FOLDER` on the host) "
            "or run as the folder's owner (`docker run --user \"$(id -u):$(id -g)\"`)."
        ) from error


def umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, in every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def follow_umask(folder: str) -> None:
    """Give every file and folder under `folder` the mode a plain open()/mkdir() would have given it.

    safetensors writes the weights through a private temporary file (mode 0600) and renames it, so
    without this the weights, and only they, are unreadable by any other uid.  Where the volume does
    not support chmod (some object-store mounts) the modes stay as they are.
    """
    mask = umask()
    for root, dirs, files in os.walk(folder):
        for name, mode in [(d, 0o777) for d in dirs] + [(f, 0o666) for f in files]:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, mode & ~mask)
                except OSError:
                    pass
    try:
        os.chmod(folder, 0o777 & ~mask)
    except OSError:
        pass
