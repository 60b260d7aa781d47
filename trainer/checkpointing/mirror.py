"""FT_MIRROR_URL, the object-store copy of the job's checkpoints and final model: what one upload, deletion or download does.

    FT_MIRROR_URL/fingerprint.json              the configuration the checkpoints belong to (trainer/core/config.py)
    FT_MIRROR_URL/checkpoints/checkpoint-N/     each committed checkpoint as on the volume, its commit.json uploaded last
    FT_MIRROR_URL/final/                        the final model (the volume's final/: an MLflow model around model/), commit.json last

A remote folder counts only with its manifest, as on the volume (trainer/checkpointing/manifest.py): an upload cut
short leaves objects without one, which nothing resumes, and a deletion removes the manifest first.  Each upload is
checked against the store's listing (every file, its size) before the manifest goes up; each download is checked
against the manifest's checksums (every byte) before the checkpoint counts on the volume.  When the uploads run is
uploads.py's; resuming from the mirror at start is restore.py's.  One job writes one mirror (as one job holds a
volume's lease): two jobs sharing an FT_MIRROR_URL would delete each other's checkpoints.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import time

from trainer.checkpointing.manifest import CHECKPOINT, CHECKSUM, MANIFEST, checksum
from trainer.core import objectstore
from trainer.core.files import write_json

FINGERPRINT = "fingerprint.json"
CHECKPOINTS = "checkpoints"
FINAL = "final"


class Gone(Exception):
    """The local checkpoint went while it was uploaded (retention removed it: a newer commit superseded it)."""


class Mirror:
    """One FT_MIRROR_URL: its filesystem (fsspec: s3fs, gcsfs, adlfs) and the layout above."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = objectstore.filesystem(self.url, "FT_MIRROR_URL")
        self.root = self.root.rstrip("/")
        self.shown = objectstore.shown(self.url)

    def where(self, *parts: str) -> str:
        """A place in the mirror as the log shows it (the URL)."""
        return "/".join([self.shown, *parts])

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # -- Reading --------------------------------------------------------------------------------------

    def check_bucket(self) -> None:
        """Raise FileNotFoundError (no such bucket or container), PermissionError (refused), or what the store's client
        raises when it does not answer."""
        self.fs.info(self.root.split("/", 1)[0])

    def read_json(self, *parts: str) -> dict | None:
        try:
            value = json.loads(self.fs.cat_file(self._path(*parts)))
        except FileNotFoundError:
            return None
        except ValueError:  # cut short or overwritten by hand: as good as absent
            return None
        return value if isinstance(value, dict) else None

    def manifest(self, *parts: str) -> dict | None:
        """The manifest of a remote folder, when it is one (files and checksums), else None."""
        found = self.read_json(*parts, MANIFEST)
        valid = found is not None and isinstance(found.get("files"), dict) and isinstance(found.get(CHECKSUM), dict)
        return found if valid else None

    def folders(self) -> list[tuple[int, str]]:
        """(step, name) of every `checkpoint-N` folder in the mirror, committed or not, oldest first."""
        try:
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path(CHECKPOINTS), detail=False)]
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)), name) for name in names if (m := CHECKPOINT.match(name)))

    def committed(self) -> dict[int, dict]:
        """step -> manifest of each committed checkpoint in the mirror."""
        found = {}
        for step, name in self.folders():
            if (manifest := self.manifest(CHECKPOINTS, name)) is not None:
                found[step] = manifest
        return found

    # -- Writing --------------------------------------------------------------------------------------

    def put_fingerprint(self, fingerprint: dict[str, str]) -> None:
        self.fs.pipe_file(self._path(FINGERPRINT), json.dumps(fingerprint, indent=1).encode())

    def upload_checkpoint(self, folder: str, manifest: dict) -> int:
        """Upload a committed checkpoint of the volume (its manifest last); the bytes sent (0: the mirror has it already)."""
        return self._upload(folder, (CHECKPOINTS, os.path.basename(folder)), manifest)

    def upload_final(self, folder: str) -> int:
        """Upload the final model folder with a manifest made for it now (the volume's final/ has none)."""
        sizes, checksums = {}, {}
        for root, _dirs, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                relative = os.path.relpath(path, folder)
                sizes[relative], checksums[relative] = os.path.getsize(path), checksum(path)
        return self._upload(folder, (FINAL,), {"files": sizes, CHECKSUM: checksums, "committed_at": time.time()})

    def _upload(self, folder: str, where: tuple[str, ...], manifest: dict) -> int:
        remote = self._path(*where)
        existing = self.manifest(*where)
        if existing is not None and same(existing, manifest):
            return 0
        if existing is not None:  # another commit of the same step (a resume from an earlier one): it stops counting first
            self.fs.rm_file(f"{remote}/{MANIFEST}")
        for relative in sorted(manifest["files"]):
            local = os.path.join(folder, relative)
            try:
                self.fs.put_file(local, f"{remote}/{relative}")
            except FileNotFoundError:
                if not os.path.exists(local):
                    raise Gone(folder) from None
                raise
        listed = {posixpath.relpath(path, remote): info.get("size") for path, info in self.fs.find(remote, detail=True).items()}
        for relative, size in manifest["files"].items():
            if listed.get(relative) != size:
                raise OSError(f"{self.where(*where, relative)} holds {listed.get(relative)} bytes after its upload, {size} on the volume")
        self.fs.pipe_file(f"{remote}/{MANIFEST}", json.dumps(manifest, indent=1).encode())  # last: now it counts
        return sum(manifest["files"].values())

    def delete(self, name: str) -> None:
        """Remove a checkpoint from the mirror: its manifest first, so that what a failure leaves behind never counts."""
        remote = self._path(CHECKPOINTS, name)
        try:
            self.fs.rm_file(f"{remote}/{MANIFEST}")
        except FileNotFoundError:
            pass
        if self.fs.find(remote):
            self.fs.rm(remote, recursive=True)

    def disown(self, name: str) -> None:
        """A checkpoint found damaged in the mirror: its manifest goes, so no start tries it again (its objects stay until
        the step is committed and uploaded anew, or retention removes them)."""
        try:
            self.fs.rm_file(self._path(CHECKPOINTS, name, MANIFEST))
        except FileNotFoundError:
            pass

    def apply_retention(self, keep: int, best: int | None) -> list[int]:
        """FT_SAVE_TOTAL_LIMIT in the mirror: keep the newest `keep` committed checkpoints and the best, remove the others and
        any older folder an upload left without a manifest; the steps removed."""
        found = self.folders()
        committed = [step for step, name in found if self.manifest(CHECKPOINTS, name) is not None]
        kept = set(committed[-keep:]) | ({best} if best is not None else set())
        newest = committed[-1] if committed else -1
        removed = [step for step, _ in found if step not in kept and step < newest]
        for step, name in found:
            if step in removed:
                self.delete(name)
        return removed

    # -- Downloading ----------------------------------------------------------------------------------

    def download(self, name: str, manifest: dict, target: str) -> str | None:
        """Download the mirror's checkpoint `name` into the folder `target` (which must not exist), checking every file's
        size and checksum before its manifest is written (so it counts); what differs, naming the file (None: intact).
        A download cut short or damaged leaves `target` absent."""
        staging = f"{target}.download"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            for relative, size in sorted(manifest["files"].items()):
                local = os.path.join(staging, relative)
                os.makedirs(os.path.dirname(local), exist_ok=True)
                self.fs.get_file(self._path(CHECKPOINTS, name, relative), local)
                if (actual := os.path.getsize(local)) != size:
                    return f"{relative} has {actual} bytes in the mirror, {size} at commit"
                if checksum(local) != manifest[CHECKSUM].get(relative):
                    return f"{relative} does not match its {CHECKSUM} checksum recorded at commit (its bytes changed in the mirror)"
            write_json(os.path.join(staging, MANIFEST), manifest)
            os.rename(staging, target)
            return None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def same(left: dict | None, right: dict | None) -> bool:
    """Two manifests list the same files with the same checksums (when each was committed does not matter)."""
    return left is not None and right is not None and left.get("files") == right.get("files") and left.get(CHECKSUM) == right.get(CHECKSUM)
