"""Batch platforms (SageMaker, Vertex AI, AWS Batch, Azure ML) and the FT_* values their variables imply."""

from __future__ import annotations

from collections.abc import Mapping


def detect(environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """Return the platform's name and the FT_* defaults it implies ("none", {} when none)."""
    return "none", {}
