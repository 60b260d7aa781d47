"""Object-store URLs (`s3://`, `gs://`, `az://`): the filesystem that reads and writes one, and the URL as a log may show it.

    fs, path = filesystem("s3://bucket/run1", "FT_MIRROR_URL")   # fsspec's filesystem (s3fs, gcsfs, adlfs) and the path in it
    shown("s3://bucket/run1")                                     # the URL for logs, params and the report
    scrub(str(error))                                             # an error message without a credential in it

Each filesystem package reads its cloud's standard credentials (AWS_* variables, IRSA's web identity token or the
instance role; GOOGLE_APPLICATION_CREDENTIALS or GKE's workload identity; AZURE_STORAGE_* or Azure's managed
identity), and AWS_ENDPOINT_URL points s3fs at an S3-compatible store.  A URL never carries a credential:
`user:password@` or a query string (an Azure SAS token) is refused at start (`url_refusal`), so the URL itself can
be logged, tracked as a parameter and printed in the run report.  fsspec is imported only when a URL is opened.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

from trainer.core.errors import ConfigError
from trainer.core.secrets import SECRET_NAME

PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
STORES = tuple(PACKAGES)  # the schemes an object-store setting (FT_MIRROR_URL) takes


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def url_refusal(url: str) -> str | None:
    """Why a URL may not be used as it is (it carries a credential), or None."""
    if "://" not in url:
        return None
    parts = urlsplit(url)
    if parts.password is not None or (parts.username and protocol(url) in ("s3", "s3a", "gs", "gcs")):
        return "must not hold a credential (user:password@): pass it through the cloud's own variables (docs/checkpoints.md#credentials)"
    if parts.query:
        return "must not hold a query string (a SAS token is a credential): pass it as AZURE_STORAGE_SAS_TOKEN (docs/checkpoints.md#credentials)"
    return None


def shown(url: str) -> str:
    """The URL as logs may show it: a credential that got into it anyway is masked (url_refusal keeps them out of settings)."""
    return scrub(url)


def scrub(text: str) -> str:
    """`text` without credentials: `//user:password@` in URLs, query strings of URLs, and the value of every variable of
    this process whose name says it is a secret (AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AZURE_STORAGE_KEY, HF_TOKEN, ...)."""
    text = re.sub(r"//[^/@\s]+@", "//****@", text)
    text = re.sub(r"(\w+://[^\s?'\"]+)\?[^\s'\"]+", r"\1?****", text)
    for name, value in os.environ.items():
        if len(value) >= 8 and SECRET_NAME.search(name) and value in text:
            text = text.replace(value, "****")
    return text


def filesystem(url: str, variable: str, **options: Any) -> tuple[Any, str]:
    """fsspec's filesystem for `url` and the path inside it; exit 2 naming `variable` when the package is missing.
    Listings are never cached: another job (or the previous attempt) may have written the store since."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, **({"use_listings_cache": False} if protocol(url) != "file" else {}), **options)
    except ImportError as error:
        package = PACKAGES.get(protocol(url), f"the fsspec filesystem for {protocol(url)}://")
        raise ConfigError(
            f"{variable}={shown(url)!r}: {protocol(url)}:// needs the {package} package, which this image lacks; install it (pip install {package})"
        ) from error
    except ValueError as error:
        raise ConfigError(f"{variable}={shown(url)!r}: unsupported URL ({scrub(str(error))})") from error
