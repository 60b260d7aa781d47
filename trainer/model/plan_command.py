"""`python entrypoint.py plan [--card NAME] [--json]`: what the job would run with on a card, before renting it.

    FT_MODEL=bench/configs/qwen3-8b python entrypoint.py plan --card h100-80gb
    FT_MODEL=./my-model FT_MAX_LENGTH=4096 FT_NUM_PROCESSES=4 python entrypoint.py plan --card h200-141gb --json
    docker run -e FT_MODEL=/models/qwen3-4b -v /models:/models IMAGE plan --card a100-80gb

From the model's config.json alone (no GPU, no weights, no torch): the same plan the job's preflight makes
(trainer/model/memory.py) for the configured FT_* settings, printed as text or JSON: the layout the cost model
(trainer/model/step_cost.py) ranks fastest among those that fit, and the two runners-up.  Exit 0 when it fits, 2 when
it does not (with the settings that would make it fit, as the preflight says), or when the settings or the
config cannot be read (a hub id while the hub is unreachable: give a local folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Any

from trainer.core import config as job_config
from trainer.core import ending, errors, locations, settings
from trainer.core.errors import ConfigError
from trainer.model import hub, memory, sizes, step_cost

# What each card reports to the job (nvidia-smi's total, in MiB, as bytes): the plan must fit this, not the name.
CARDS = {
    "h100-80gb": 81_559 * 2**20,  # measured on an H100 SXM 80 GB (bench/scale_plan.py)
    "h200-141gb": 143_771 * 2**20,
    "a100-80gb": 81_920 * 2**20,
    "a100-40gb": 40_960 * 2**20,
    "l40s-48gb": 46_068 * 2**20,
}
DEFAULT_CARD = "h100-80gb"  # the reference job's card


def read_config(model: str, revision: str) -> tuple[Any, str]:
    """The model's config.json as an object with attributes, and where it was read; no transformers (which imports torch)."""
    candidates = [model] if model.endswith(".json") else [os.path.join(model, "config.json")]
    for path in candidates:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return _attributes(json.load(f)), path
    if not locations.is_hub_id(model) or model.endswith(".json"):  # the job's one rule for a local path or a hub id
        raise ConfigError(f"FT_MODEL={model!r}: no config.json there; `plan` needs only that file of the model")
    local = "set FT_MODEL to a local folder holding it (bench/configs/ has Qwen3-8B, 14B and 32B; bench/qwen3-4b-config.json is Qwen3-4B)"
    # Asked once first: huggingface_hub's own five retries of an unreachable hub took 24 s before the same message.
    if why := hub.unreachable(tries=1):
        raise ConfigError(f"FT_MODEL={model!r}: the Hugging Face hub does not answer ({why}). `plan` needs only the model's config.json: {local}")
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model, "config.json", revision=revision or None)
    except (OSError, ValueError) as error:  # offline, unreachable, unknown repo (huggingface_hub's errors subclass these)
        raise ConfigError(f"FT_MODEL={model!r}: cannot read its config.json from the Hugging Face hub ({type(error).__name__}). `plan` needs only "
                          f"that file: {local}") from None
    with open(path, encoding="utf-8") as f:
        return _attributes(json.load(f)), model


def _attributes(values: dict[str, Any]) -> Any:
    text = values.get("text_config") or values  # a multimodal config keeps its language model's sizes there
    return types.SimpleNamespace(**{**values, **text, "architectures": values.get("architectures")})


def capacity(card: str | None, validated: settings.Settings) -> tuple[str, float]:
    """`--card` if given, else FT_GPU_MEMORY_GB if set, else the reference job's card."""
    if card:
        if card not in CARDS:
            raise ConfigError(f"--card {card!r} is not a card this plan knows: use one of "
                              f"{', '.join(CARDS)}, or set FT_GPU_MEMORY_GB to the card's memory in GB")
        return card, float(CARDS[card])
    if validated.gpu_memory_gb:
        return f"FT_GPU_MEMORY_GB={validated.gpu_memory_gb:g}", validated.gpu_memory_gb * memory.GB
    return DEFAULT_CARD, float(CARDS[DEFAULT_CARD])


def report(validated: settings.Settings, card: str | None, write_mb_s: float = sizes.DEFAULT_WRITE_MB_S,
           mean_tokens: float | None = None) -> tuple[dict[str, Any], list[str]]:
    """The plan as data, and the fixes when it does not fit.  `mean_tokens`: of a sequence after preparation (else the
    data prepared on the volume's, else FT_MAX_LENGTH)."""
    config, source = read_config(validated.model, validated.model_revision)
    name, limit = capacity(card, validated)
    precision = job_config.PRECISIONS["bf16-mixed" if validated.precision == "auto" else validated.precision]  # auto on a bf16 GPU
    processes = (validated.num_processes or 1) * validated.num_nodes
    n_params = memory.parameter_count(config)
    device = step_cost.device_for(name, limit)
    tokens, tokens_from = (min(mean_tokens, validated.max_length), "--mean-tokens") if mean_tokens else step_cost.mean_tokens(validated)
    chosen = memory.plan(config, n_params, validated, precision, limit, validated.activation_checkpointing, processes, device, tokens)
    fixes = [] if chosen.fits else memory._fixes(config, n_params, validated, precision, limit, processes)
    layers = memory.shape(config)["layers"]
    data = {
        "model": source,
        "parameters": n_params,
        "card": name,
        "capacity_gb": round(limit / memory.GB, 1),
        "precision": precision.name,
        "max_length": validated.max_length,
        "sequences_per_pass": chosen.sequences_per_pass,
        "passes_per_step": chosen.passes_per_step,
        "checkpoint_every": chosen.checkpoint_every,
        "recomputation": memory.checkpointing_label(chosen.checkpoint_every, layers),
        "processes": chosen.processes,
        "strategy": chosen.strategy,
        "replicas": chosen.replicas,
        "peak_gb": round(chosen.peak / memory.GB, 2),
        "peak_phase": chosen.phase,
        "fits": chosen.fits,
        "breakdown_gb": {k: round(v / memory.GB, 2) for k, v in chosen.breakdown.items()},
        "fixes": fixes,
        "offload": chosen.offload,
        "step_seconds": round(chosen.seconds, 3),
        "cost_device": device.name,
        "tokens_per_sequence": round(tokens),
        "tokens_from": tokens_from,
        "runners_up": [_layout(other, chosen, layers) for other in runners_up(config, n_params, validated, precision, chosen)],
    }
    written = sizes.of(n_params, precision, validated.save_total_limit, write_mb_s)
    data |= {"checkpoint_gb": round(written.checkpoint / 1e9, 1), "final_model_gb": round(written.final_model / 1e9, 1),
             "volume_gb": round(written.volume / 1e9, 1), "checkpoints_at_once": written.checkpoints_at_once,
             "write_mb_s": write_mb_s, "write_seconds": round(written.write_seconds)}
    return data, fixes


def runners_up(config: Any, n_params: int, validated: settings.Settings, precision: Any, chosen: memory.Plan, count: int = 2) -> list[memory.Plan]:
    """The next fastest layouts that fit after `chosen`, each of other sequences per pass (the fastest of each)."""
    layouts = memory.candidates(config, n_params, validated, precision, chosen.capacity, validated.activation_checkpointing, chosen.processes,
                                chosen.strategy, chosen.replicas, chosen.device, chosen.tokens_per_sequence)
    seen, found = {chosen.sequences_per_pass}, []
    for other in layouts:
        if other.fits and other.sequences_per_pass not in seen and len(found) < count and other.seconds >= chosen.seconds:
            seen.add(other.sequences_per_pass)
            found.append(other)
    return found


def _layout(plan: memory.Plan, chosen: memory.Plan, layers: int) -> dict[str, Any]:
    return {"sequences_per_pass": plan.sequences_per_pass, "passes_per_step": plan.passes_per_step, "checkpoint_every": plan.checkpoint_every,
            "recomputation": memory.checkpointing_label(plan.checkpoint_every, layers), "offload": plan.offload, "peak_gb": round(plan.peak / memory.GB, 2),
            "step_seconds": round(plan.seconds, 3), "relative_step_time": round(plan.seconds / chosen.seconds, 3) if chosen.seconds else None}


def describe(data: dict[str, Any]) -> str:
    within = f" within each of {data['replicas']} nodes, replicated across them" if data["replicas"] > 1 else ""
    sharing = "one process" if data["processes"] == 1 else f"{data['processes']} processes ({data['strategy']}{within})"
    lines = [
        f"fulltune plan: {data['model']} ({data['parameters'] / 1e9:.2f} B parameters), {data['precision']}, "
        f"FT_MAX_LENGTH={data['max_length']}, on {data['card']} ({data['capacity_gb']} GB)",
        f"  layout:        {data['sequences_per_pass']} sequences x {data['passes_per_step']} passes per optimizer step, {sharing}",
        f"  recomputation: {data['recomputation']}{', offloaded to host memory' if data['offload'] else ''}",
        f"  peak:          ~{data['peak_gb']:.1f} GB per GPU, in the {data['peak_phase']}: {'fits' if data['fits'] else 'does NOT fit'}",
    ]
    lines += [f"    {name:<16}{gb:>8.2f} GB" for name, gb in data["breakdown_gb"].items()]
    lines.append(f"  step time:     ~{data['step_seconds']:.2f} s estimated ({data['cost_device']} speeds, trainer/model/step_cost.py), sequences of "
                 f"{data['tokens_per_sequence']} tokens ({data['tokens_from']})")
    for i, other in enumerate(data["runners_up"]):
        offloaded = ", offloaded" if other["offload"] else ""
        lines.append(f"  {'runners-up:' if i == 0 else '':<15}{other['sequences_per_pass']} x {other['passes_per_step']}, recomputation "
                     f"{other['recomputation']}{offloaded}: ~{other['peak_gb']:.1f} GB, {other['relative_step_time']:.2f}x the step time")
    lines += [
        f"  checkpoint:    {data['checkpoint_gb']:.1f} GB (weights + optimizer states); final model {data['final_model_gb']:.1f} GB",
        f"  volume:        at least {data['volume_gb']:.0f} GB ({data['volume_gb'] * 1e9 / 2**30:.0f} GiB): {data['checkpoints_at_once']} checkpoints at "
        f"once (FT_SAVE_TOTAL_LIMIT + the best + the one being written), the final model and the base model's download",
        f"  one write:     ~{data['write_seconds']} s at {data['write_mb_s']:g} MB/s (--write-mb-s); FT_STOP_DEADLINE_SECONDS must hold it",
    ]
    if data["fixes"]:
        lines.append("  to fit, set " + "; or ".join(data["fixes"]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="entrypoint.py plan", description="The memory plan for the configured FT_* settings on a "
                                                                            "card, from config.json alone.")
    parser.add_argument("--card", help=f"one of {', '.join(CARDS)} (default: FT_GPU_MEMORY_GB if set, else {DEFAULT_CARD})")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--mean-tokens", type=float, help="tokens of a mean sequence after preparation, for the step time (default: of the data "
                                                          "prepared on FT_OUTPUT_DIR, else FT_MAX_LENGTH)")
    parser.add_argument("--write-mb-s", type=float, default=sizes.DEFAULT_WRITE_MB_S,
                        help=f"the volume's sequential write speed for the checkpoint's write time (default {sizes.DEFAULT_WRITE_MB_S:g})")
    args = parser.parse_args(argv)
    ending.set_termination_message_path(os.environ.get("FT_TERMINATION_MESSAGE_PATH", ""))  # a question, not a job: no termination log
    try:
        data, fixes = report(settings.load(os.environ), args.card, args.write_mb_s, args.mean_tokens)
    except errors.FulltuneError as error:
        return ending.exit_code_for(error)
    print(json.dumps(data) if args.json else describe(data), flush=True)
    return 0 if data["fits"] else ConfigError.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
