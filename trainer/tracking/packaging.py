"""The saved model: one MLflow model folder, which serving and the registry share (one copy of the weights).

    save_model(net, tokenizer, volume.final, metadata, served_name)
"""

from __future__ import annotations

import os
from typing import Any


def save_model(net: Any, tokenizer: Any, path: str, metadata: dict[str, str], served_name: str) -> None:
    """Write the model once: an MLflow pyfunc model (trainer/serving/pyfunc.py, saved from code) that answers OpenAI-style
    chat requests as `served_name`, around a `model/` folder that is also a plain transformers folder (weights +
    tokenizer), so serving and the registry share one copy.

    Not the transformers flavor: its llm/v1/chat endpoint fails `temperature: 0` and names the model by a path
    (trainer/serving/pyfunc.py says why)."""
    import mlflow

    from trainer.serving import pyfunc as serving

    mlflow.pyfunc.save_model(
        path=path,
        python_model=serving.__file__,
        model_config={serving.MODEL_NAME_KEY: served_name},
        signature=serving.SIGNATURE,
        input_example=serving.INPUT_EXAMPLE,  # saved as the model's example request; with a signature given, MLflow does not run it
        metadata=metadata,
        pip_requirements=_serving_requirements(),
    )
    net.save_pretrained(os.path.join(path, serving.WEIGHTS))  # after: MLflow saves only into an empty folder
    tokenizer.save_pretrained(os.path.join(path, serving.WEIGHTS))
    saved = mlflow.models.Model.load(path)
    saved.model_size_bytes = sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)  # with the weights
    saved.save(os.path.join(path, "MLmodel"))


def _serving_requirements() -> list[str]:
    """Pin what serving needs; without this, MLflow infers extras such as torchvision."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "transformers", "accelerate", "safetensors", "tokenizers")]
