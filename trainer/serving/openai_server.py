"""The registered model behind an OpenAI-compatible server: `transformers serve` on its `model/` folder, under its
registered name, so that `OpenAI(base_url="http://host:8000/v1")` lists it (`models.list`) and chats with it
(`chat.completions.create`, streaming included).

    python -m trainer.serving.openai_server models:/<name>/<version> --host 0.0.0.0 --port 8000
    python -m trainer.serving.openai_server /output/final            # the folder on the volume, no registry

Options other than the two below go to `transformers serve` unchanged (`--device`, `--dtype`, `--continuous-batching`,
`--log-level`, ...).  With GPUs, vLLM's server serves the same folder (docs/tracking-and-serving.md#serving-the-trained-model).

Why transformers serve and not MLflow: `mlflow models serve` answers `POST /invocations` alone, and MLflow's AI
Gateway is a proxy to a provider that already speaks OpenAI (its "mlflow-model-serving" provider forwards only the
first message's text to /invocations).  transformers serve is Hugging Face's own OpenAI-compatible server, ships
with the transformers this project pins, loads a plain transformers folder and streams.

What is written here is only what it lacks: it loads a model by the name it is asked for, a hub id or a local path,
and answers under that name.  So the model folder is given the served name as a link in a folder of its own, and
the server is started there with that name.  Like pyfunc.py, this imports nothing of fulltune.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

WEIGHTS = "model"  # the transformers folder inside the saved MLflow model (pyfunc.WEIGHTS)
MODEL_NAME_KEY = "served_model_name"  # the saved model's model_config key for its name (pyfunc.MODEL_NAME_KEY)


class NotServable(Exception):
    """The model to serve is missing or is not a transformers folder; the message says what to give instead."""

    exit_code = 2  # a retry cannot help


class StoreFailed(Exception):
    """The MLflow server or store did not give the model (not answering, an error of its own)."""

    exit_code = 1  # a retry may help


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.serving.openai_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="models:/<name>/<version>, models:/<name>@<alias>, runs:/<run>/<path>, "
                                      "or a folder: final/ (an MLflow model) or final/model/")
    parser.add_argument("--served-model-name", help="the name clients send as `model` and /v1/models lists (default: the name the job registered)")
    parser.add_argument("--download-dir", help="where a model from a remote store is downloaded (default: a new temporary folder each start)")
    args, serve_options = parser.parse_known_args(argv)
    try:
        folder, name = resolve(args.model, args.download_dir)
        workdir = named_link(folder, args.served_model_name or name)
    except (NotServable, StoreFailed) as error:
        print(f"fulltune serve: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None
    print(f"fulltune serve: {folder} as {args.served_model_name or name!r}: OpenAI base_url http://<host>:<port>/v1", flush=True)
    os.chdir(workdir)
    env = os.environ | {"HF_HUB_DISABLE_UPDATE_CHECK": os.environ.get("HF_HUB_DISABLE_UPDATE_CHECK", "1")}  # the CLI asks PyPI for a newer transformers
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", args.served_model_name or name, *serve_options]
    os.execve(sys.executable, command, env)  # the server becomes this process: a signal to it reaches uvicorn directly


def resolve(model: str, download_dir: str | None = None) -> tuple[Path, str]:
    """The transformers folder to serve and the name it was saved to answer under."""
    if ":/" in model and not os.path.exists(model):
        model = _download(model, download_dir)
    path = Path(model).resolve()
    if path.name == WEIGHTS and (path.parent / "MLmodel").is_file():
        path = path.parent  # final/model/: the name is in final/MLmodel
    if not path.is_dir():
        raise NotServable(f"{model}: no such folder; give models:/<name>/<version>, or the job's final/ folder (FT_OUTPUT_DIR/final)")
    if (path / "MLmodel").is_file() and (path / WEIGHTS).is_dir():
        return _transformers_folder(path / WEIGHTS, model), _saved_name(path) or path.name
    return _transformers_folder(path, model), path.name


def named_link(folder: Path, name: str) -> Path:
    """A new folder holding one link, `name` -> `folder`, for the server to be started in."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts:
        raise NotServable(f"--served-model-name {name!r}: a name such as my-model or org/my-model, not a path")
    workdir = Path(tempfile.mkdtemp(prefix="fulltune-serve-"))
    link = workdir / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(folder, target_is_directory=True)
    return workdir


def _download(uri: str, download_dir: str | None) -> str:
    """The local folder of an MLflow model URI (on a local store, its own folder: nothing is copied)."""
    if not os.environ.get("MLFLOW_TRACKING_URI") and not os.environ.get("MLFLOW_REGISTRY_URI"):  # MLflow would make an empty ./mlflow.db
        raise NotServable(f"{uri}: MLFLOW_TRACKING_URI is not set, so there is no registry to find it in. Set it to the job's store: "
                          "sqlite:///<FT_OUTPUT_DIR>/mlflow/mlflow.db for the embedded one (after the demo: "
                          "MLFLOW_TRACKING_URI=sqlite:///$PWD/out/mlflow/mlflow.db), or your tracking server's URL; "
                          "or give the job's final/ folder instead")
    import mlflow
    from mlflow.exceptions import MlflowException

    def hidden(text: str) -> str:  # MLflow's errors quote the server's URL, password included
        return re.sub(r"//[^/@\s]*@", "//****@", text)

    store = hidden(mlflow.get_registry_uri())
    try:
        return mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=download_dir)
    except MlflowException as error:
        why = hidden(" ".join(error.message.split()))
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise NotServable(f"{uri}: {why.rstrip('.')} in the registry {store} (MLFLOW_TRACKING_URI); "
                              "the job registers models:/<FT_REGISTERED_MODEL>/<version>") from None
        raise StoreFailed(f"{uri}: the registry {store} did not give the model ({why[:300]}); try again once it answers") from None


def _saved_name(path: Path) -> str | None:
    from mlflow.models import Model

    return Model.load(str(path)).flavors.get("python_function", {}).get("config", {}).get(MODEL_NAME_KEY)


def _transformers_folder(path: Path, given: str) -> Path:
    if not (path / "config.json").is_file():
        raise NotServable(f"{given}: {path} has no config.json, so it is not a transformers model folder; give the job's final/ or final/model/ folder")
    return path


if __name__ == "__main__":
    main()
