"""FT_PUSH_TO_HUB=org/name: the final model and its model card on the Hugging Face hub, pushed with huggingface_hub.

    check_token(settings)                               # at start: exit 2 without a token, before anything trains
    write_card(config, volume, metadata, tracker, state)  # final/model/README.md: base model, data, hyperparameters, results, the run
    add_evaluation(volume, table)                       # the evaluation stage's before/after table, once it has run
    push(settings, volume)                              # create the repository (private by default) and upload the folder

The card is written on the volume beside the weights, so the mirror's copy has it too and a retry after a failed push
(exit 8) pushes the same card without the facts of the run that trained it.  The repository is created private unless
FT_HUB_PRIVATE=false; one that exists keeps its visibility.  huggingface_hub reads HF_TOKEN (or the token saved by
`hf auth login`) and HF_ENDPOINT; the token is never logged.
"""

from __future__ import annotations

import os
from typing import Any

from trainer.core import locations, objectstore
from trainer.core import settings as settings_table
from trainer.core.config import Config
from trainer.core.errors import ConfigError, HubPushFailed
from trainer.core.files import write_text
from trainer.core.volume import Volume
from trainer.tracking.server import redact

CARD = "README.md"  # the hub shows a repository's README.md as its model card
EVALUATION_HEADING = "## Base model against the fine-tuned one"
WHY_CHARACTERS = 300


def check_token(settings: settings_table.Settings) -> None:
    if not settings.push_to_hub:
        return
    from huggingface_hub import get_token

    if not get_token():
        raise ConfigError(f"FT_PUSH_TO_HUB={settings.push_to_hub} needs a Hugging Face token with write access: set HF_TOKEN "
                          "(or unset FT_PUSH_TO_HUB); nothing was trained")


def card(config: Config, metadata: dict[str, str], run: dict[str, Any], state: Any) -> str:
    """The model card: YAML metadata the hub indexes (base model, data set, library), then what a reader asks of a fine-tune."""
    settings = config.settings
    base = metadata.get("pretrained_model_name", settings.model)  # the demo's is its own name, not a path on this machine
    data = settings.dataset
    header = ["---", f"base_model: {base}" if locations.is_hub_id(settings.model) else "", "library_name: transformers", "pipeline_tag: text-generation",
              *( [f"datasets:\n- {data}"] if locations.is_hub_id(data, data=True) else []), "tags:\n- fulltune\n- full-fine-tuning\n- sft", "---"]
    params = settings_table.as_params(settings)
    changing = {f"FT_{name.upper()}" for name in settings_table.changing(settings, ("data", "training"))}
    rows = "\n".join(f"| `{name}` | `{value}` |" for name, value in sorted(params.items()) if name in changing)
    evals = [(entry["step"], entry["eval_loss"]) for entry in getattr(state, "log_history", []) if "eval_loss" in entry]
    results = "\n".join(f"| {step} | {loss:.4f} |" for step, loss in evals) or "| - | no evaluation (FT_EVAL_FRACTION=0 and no FT_EVAL_DATASET) |"
    best = getattr(state, "best_metric", None)
    return "\n".join(line for line in header if line) + f"""

# {settings.push_to_hub.split("/", 1)[1]}

Every weight of `{base}` fine-tuned with TRL's `SFTTrainer` by fulltune ({metadata.get("model_size_parameters", "?")} parameters,
{config.precision.name} training, weights saved in {config.precision.serving_dtype}). It loads with `AutoModelForCausalLM.from_pretrained`.

## Base model

`{base}`{f" at revision `{settings.model_revision}`" if settings.model_revision else ""}.

## Data

`{objectstore.shown(data)}`, split `{settings.dataset_split}`, format `{settings.data_format}`, loss on `{settings.loss_on}` tokens, at most
{settings.max_length} tokens per sequence; validation: `{objectstore.shown(settings.eval_dataset) or f"{settings.eval_fraction:g} of the rows"}`.

## Hyperparameters

| Setting | Value |
|---|---|
{rows}
| precision | `{config.precision.name}` |
| processes | `{config.world_size}` |

## Evaluation results

| Step | eval_loss |
|---|---|
{results}

{f"The final model is the checkpoint with the lowest eval_loss, {best:.4f}." if best is not None else "The final model is the last step's."}

## The run

MLflow run `{run.get("run_id", "?")}` (experiment `{run.get("experiment_id", "?")}`) at `{redact(run.get("tracking_uri", "?"))}`,
{getattr(state, "global_step", "?")} of {settings.max_steps} optimizer steps.
"""


def write_card(config: Config, volume: Volume, metadata: dict[str, str], tracker: Any, state: Any) -> None:
    write_text(os.path.join(volume.final_model, CARD), card(config, metadata, tracker.facts(), state))


def add_evaluation(volume: Volume, table: str) -> None:
    """The evaluation stage's before/after table (Markdown: the registered version's description,
    trainer/evaluation/compare.py) in the card, once the stage has scored both models; replaced, not added twice, by a restart."""
    path = os.path.join(volume.final_model, CARD)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        text = f.read().split(EVALUATION_HEADING)[0].rstrip("\n")
    write_text(path, f"{text}\n\n{EVALUATION_HEADING}\n\n{table}\n")


def push(settings: settings_table.Settings, volume: Volume) -> str:
    """Create the repository if needed and upload the final model folder (weights, tokenizer, card) in one commit; its URL.
    HubPushFailed (exit 8) when the hub does not answer or refuses."""
    from huggingface_hub import HfApi

    repository = settings.push_to_hub
    print(f"fulltune: pushing the final model and its card to the Hugging Face hub as {repository} "
          f"({'private' if settings.hub_private else 'public'} if it is created)", flush=True)
    try:
        api = HfApi()
        url = api.create_repo(repository, private=settings.hub_private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repository, folder_path=volume.final_model, repo_type="model", commit_message="fulltune: the final model and its card")
    except Exception as error:  # noqa: BLE001 - whatever the hub or the network says, the model stays on the volume and a retry pushes it
        why = " ".join(objectstore.scrub(f"{type(error).__name__}: {error}").split())[:WHY_CHARACTERS]
        raise HubPushFailed(f"the model is trained and saved at {os.path.abspath(volume.final_model)}, but pushing it to the Hugging Face hub as"
                            f" {repository} failed ({why}). Re-run the job once the hub answers (and HF_TOKEN may write there): it only pushes,"
                            " without training.") from None
    return str(url)
