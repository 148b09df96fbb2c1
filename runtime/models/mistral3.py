"""Mistral's multimodal layout (`mistral3`: Mistral Small 3.1 and 3.2, Devstral Small,
Magistral Small, Ministral 3): the text model's config under `text_config`, a
`mistral` (llama's decoder) or a `ministral3`; loaded as that text model, the vision
tower skipped (runtime/models/multimodal.py), as mlx-lm's `mistral3` does.
"""

from __future__ import annotations

from typing import Any

from runtime.errors import CheckpointError
from runtime.models import multimodal

TEXT_MODEL_TYPES = ("mistral", "ministral3")


def unwrap_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    text = multimodal.text_config(raw, source, "mistral")
    if text["model_type"] not in TEXT_MODEL_TYPES:
        raise CheckpointError(
            f"{source}: mistral3 with a text model of type {text['model_type']!r} is not supported "
            f"(supported: {', '.join(TEXT_MODEL_TYPES)})"
        )
    return text
