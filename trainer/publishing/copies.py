"""The copies of the saved model beyond the volume, before the job reports success: FT_MIRROR_URL holds the final model
and every committed checkpoint (waited for up to FT_MIRROR_WAIT_SECONDS), then FT_PUSH_TO_HUB gets the model and its
card.  Either one missing is exit 8 with the model kept on the volume; the retry (trainer/job.py sees the saved model
and trains nothing) comes back here and does only what is missing, as its status on the volume says.
"""

from __future__ import annotations

import os

from trainer.checkpointing import restore, uploads
from trainer.checkpointing.mirror import Mirror
from trainer.core import objectstore, ranks
from trainer.core.config import Config
from trainer.core.errors import MirrorBehind, MirrorUnusable
from trainer.core.settings import Settings
from trainer.core.volume import Volume
from trainer.publishing import hub_push


def mirror_name(settings: Settings) -> str:
    """FT_MIRROR_URL as the volume's status records that the mirror holds the job ("" without one)."""
    return objectstore.shown(settings.mirror_url.rstrip("/")) if settings.mirror_url else ""


def deliver(config: Config, volume: Volume, mirroring: uploads.Uploads | None) -> None:
    """`mirroring`: the job's uploads, told of the final model already; None on a retry, which starts its own."""
    settings = config.settings
    if not ranks.is_main():
        return
    if settings.mirror_url and volume.status().mirrored != mirror_name(settings):
        if mirroring is None:  # a retry: the mirror's fingerprint is checked (exit 2); a store that does not answer is waited for below
            try:
                mirror = restore.from_mirror(config, volume)
            except MirrorUnusable:
                mirror = Mirror(settings.mirror_url)
            mirroring = uploads.Uploads(mirror, volume, settings.save_total_limit)
            mirroring.final()
        if not mirroring.settle(settings.mirror_wait_seconds):
            registered = f", registered as {volume.status().registered}," if volume.status().registered else ""
            raise MirrorBehind(
                f"the model is trained and saved at {os.path.abspath(volume.final)}{registered} but FT_MIRROR_URL={mirroring.mirror.shown} has not"
                f" received {mirroring.behind()} within FT_MIRROR_WAIT_SECONDS={settings.mirror_wait_seconds} ({mirroring.last_error or 'still uploading'})."
                " Re-run the job once the store answers: it only uploads, without training."
            )
        volume.mark_mirrored(mirror_name(settings))
        print(f"fulltune: mirror {mirroring.mirror.shown} holds the final model and every committed checkpoint of the volume", flush=True)
    if settings.push_to_hub and volume.status().pushed != settings.push_to_hub:
        url = hub_push.push(settings, volume)  # exit 8 when it fails
        volume.mark_pushed(settings.push_to_hub)
        print(f"fulltune: pushed the final model and its card to {url}", flush=True)
