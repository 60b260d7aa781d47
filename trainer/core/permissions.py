"""Who can write the volume, and who can read what the job wrote.

The volume usually outlives the job and is read by someone else: a serving pod, a notebook or a copy
job that runs under another uid on the same PersistentVolumeClaim.
"""

from __future__ import annotations

import errno
import os
import tempfile

from trainer.core.errors import ConfigError


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
        raise ConfigError(_why_not_writable(output_dir, error)) from error


def _why_not_writable(output_dir: str, error: OSError) -> str:
    """What stopped the write, and the fix that can help: a file in the way, a read-only mount, root refused, another uid."""
    if blocking := _file_in_the_way(output_dir):
        return (f"FT_OUTPUT_DIR={output_dir} cannot be a folder: {blocking} is a file. Point FT_OUTPUT_DIR at a folder "
                "(the mounted volume; a missing one is created) or move the file away")
    if error.errno == errno.EROFS:  # no owner or fsGroup can write a read-only mount
        return (f"FT_OUTPUT_DIR={output_dir} is on a read-only mount: the job writes its checkpoints and model there. Mount the volume read-write "
                "(Kubernetes: drop `readOnly: true` from the volumeMount and the claim's ReadOnlyMany access mode; docker run: drop `:ro` from -v), "
                "or point FT_OUTPUT_DIR at a writable volume")
    uid, gid = os.getuid(), os.getgid()
    owner = _owner(output_dir)
    if uid == 0:  # root is refused only where permissions are not its to override: a squashed NFS export, a dropped capability
        run_as, where = "run as the folder's owner", ""
        if owner:
            run_as += f" (`docker run --user {owner[0]}:{owner[1]}`; Kubernetes: runAsUser: {owner[0]})"
            where = f" (owned by uid {owner[0]}, gid {owner[1]})"
        return (f"FT_OUTPUT_DIR={output_dir} is not writable although this process runs as root (uid 0): {error.strerror}{where}. "
                "Root is refused where the volume does not let it override permissions: an NFS export with root squash (root acts as nobody "
                "there) or a container without the CAP_DAC_OVERRIDE capability. Make the folder writable by its group or everyone, or " + run_as)
    return (f"FT_OUTPUT_DIR={output_dir} is not writable by this process (uid {uid}, gid {gid}): {error.strerror}. "
            f"Give uid {uid} write access to the volume: on Kubernetes set the pod's securityContext.fsGroup (e.g. fsGroup: {gid}); "
            f"with docker run, mount a folder owned by uid {uid} (`chown {uid}:{gid} FOLDER` on the host) "
            "or run as the folder's owner (`docker run --user \"$(id -u):$(id -g)\"`).")


def _file_in_the_way(path: str) -> str | None:
    """`path` or the first folder on its way that exists as something other than a folder."""
    parts = os.path.abspath(path).split(os.sep)
    for end in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:end])
        if not os.path.exists(prefix):
            return None
        if not os.path.isdir(prefix):
            return prefix
    return None


def _owner(path: str) -> tuple[int, int] | None:
    """The uid and gid of `path`, or of the nearest folder above it that exists."""
    while path and path != os.path.dirname(path):
        try:
            found = os.stat(path)
            return found.st_uid, found.st_gid
        except OSError:
            path = os.path.dirname(path)
    return None


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
