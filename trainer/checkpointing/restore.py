"""At start, with FT_MIRROR_URL: the mirror answers, holds this configuration's checkpoints, and, when its newest committed
checkpoint is newer than the volume's (an empty volume: a new node, a wiped scratch disk), that one is downloaded.

    mirror = restore.from_mirror(config, volume)   # None without FT_MIRROR_URL (or on ranks other than 0)

The download is checked file by file against the checksums of the mirror's manifest, and counts on the volume only
once every file matches (mirror.py); a damaged one is named, disowned in the mirror and the one before it is tried.
The best checkpoint (by eval loss, named in the newest one's trainer state) comes down too, because the final model
is the best one.  From then on the volume holds the checkpoint and the job resumes from it as it always does
(trainer/checkpointing/commits.py), exactly.
"""

from __future__ import annotations

import os
import time

from trainer.checkpointing import manifest as manifests
from trainer.checkpointing.mirror import CHECKPOINTS, FINGERPRINT, Mirror
from trainer.checkpointing.uploads import best_step
from trainer.core import config as job_config
from trainer.core import objectstore, probe, ranks
from trainer.core.config import Config
from trainer.core.errors import ConfigError, MirrorUnusable
from trainer.core.files import read_json, write_json
from trainer.core.volume import Volume

START_TRIES = 3  # the store's client retries each call itself (s3fs: about 10 s against a closed port)


def from_mirror(config: Config, volume: Volume) -> Mirror | None:
    """Open FT_MIRROR_URL (exit 1 when it does not answer, 2 when its bucket is missing, refuses us or holds another
    configuration's checkpoints) and bring its newest committed checkpoint onto the volume when the volume's is older."""
    url = config.settings.mirror_url
    if not url or not ranks.is_main():
        return None
    mirror = Mirror(url)
    _check_answers(mirror)
    if (recorded := mirror.read_json(FINGERPRINT)) is not None:
        if differences := job_config.check_recorded(config, recorded, mirror.shown):
            print("fulltune: FT_ALLOW_CONFIG_CHANGE=true: resuming from the mirror despite " + "; ".join(differences), flush=True)
        if read_json(volume.fingerprint_file) is None:  # an empty volume takes the mirror's record: what the data resolves to is compared once prepared
            write_json(volume.fingerprint_file, recorded)
    local = manifests.last_committed(volume.checkpoints)
    local_step = int(local.rsplit("-", 1)[1]) if local else -1
    remote = mirror.committed()
    for step in sorted(remote, reverse=True):
        if step <= local_step:
            break
        if _download(mirror, volume, step, remote[step]):
            best = best_step(os.path.join(volume.checkpoints, f"checkpoint-{step}"))
            if best is not None and best != step and best in remote and not manifests.is_committed(_local(volume, best)):
                _download(mirror, volume, best, remote[best], why="the best checkpoint, which becomes the final model")
            break
    return mirror


def _check_answers(mirror: Mirror) -> None:
    def ask() -> str | None:
        try:
            mirror.check_bucket()
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as error:  # noqa: BLE001 - any other failure is a store that does not answer (yet)
            return f"{type(error).__name__}: {' '.join(objectstore.scrub(str(error)).split())[:200]}"
        return None

    try:
        why = probe.answers(ask, START_TRIES)
    except FileNotFoundError as error:
        raise ConfigError(f"FT_MIRROR_URL={mirror.shown}: its bucket or container does not exist ({objectstore.scrub(str(error))}); "
                          "create it, or fix the URL") from None
    except PermissionError as error:
        raise ConfigError(f"FT_MIRROR_URL={mirror.shown}: the store refuses these credentials ({objectstore.scrub(str(error))}); "
                          "docs/checkpoints.md#credentials says which each cloud reads") from None
    if why is not None:
        raise MirrorUnusable(f"FT_MIRROR_URL={mirror.shown}: the object store does not answer ({why}). Nothing was trained; "
                             "a retry helps once it answers (AWS_ENDPOINT_URL names an S3-compatible store's address)")


def _local(volume: Volume, step: int) -> str:
    return os.path.join(volume.checkpoints, f"checkpoint-{step}")


def _download(mirror: Mirror, volume: Volume, step: int, manifest: dict, why: str = "") -> bool:
    """Bring one mirrored checkpoint onto the volume, verified; False (with a warning) when the mirror's copy is damaged."""
    from trainer.checkpointing.commits import set_aside

    name, target = f"checkpoint-{step}", _local(volume, step)
    if os.path.exists(target):  # never committed (the newer committed ones are the mirror's): set aside as at any start
        set_aside(target, volume.incomplete)
    os.makedirs(volume.checkpoints, exist_ok=True)
    began = time.perf_counter()
    problem = mirror.download(name, manifest, target)
    url = mirror.where(CHECKPOINTS, name)
    if problem is not None:
        mirror.disown(name)
        print(f"fulltune: warning: the mirror's checkpoint at step {step} is damaged, not resumed: {problem} ({url}); "
              "its manifest is removed from the mirror, and the one before it is tried", flush=True)
        return False
    size = manifests.committed_bytes(target) / 1e6
    print(f"fulltune: {'downloaded ' + why if why else 'resuming from the mirror'}: {url} ({size:.1f} MB in "
          f"{time.perf_counter() - began:.1f} s, every file's {manifests.CHECKSUM} checksum verified) into {target}", flush=True)
    return True
