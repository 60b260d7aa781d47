"""The evaluation stage: after the final model is saved, score the base and the fine-tuned model, then gate.

    units, in order:  base: own task, each benchmark  ->  fine-tuned: own task, each benchmark
    FT_OUTPUT_DIR/evaluation/<model>-<unit>.json   each unit's result, written when it is done
    FT_OUTPUT_DIR/evaluation/summary.json          the before/after table, once every unit is done

Rank 0 alone evaluates, after the training model is freed (job.py), loading each model once for its units: the
base from FT_MODEL, the fine-tuned from the saved final model.  A stop signal here ends the job at once with 75
(trainer/checkpointing/preemption.py): the units done are on the volume, and the retry skips training and every
unit done, so it evaluates only what is left.  The base's benchmark scores also go to FT_EVAL_CACHE_DIR
(base_scores.py).  A unit's file records what it was computed with (`key`): other settings redo it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from typing import Any

from trainer.core import collector
from trainer.core.config import Config
from trainer.core.errors import RegressionFound
from trainer.core.files import read_json, write_json
from trainer.core.volume import Volume
from trainer.evaluation import base_scores, compare, harness, own_task, tasks
from trainer.model import loading

MODELS = ("base", "tuned")
SHOWN = {"base": "base model", "tuned": "fine-tuned model"}


def keep_rows(config: Config, eval_rows: Any, tokenizer: Any) -> None:
    """Before training (rank 0): the FT_EVAL_ROWS rows the stage will score, chosen once."""
    settings = config.settings
    if settings.eval_rows:
        own_task.keep_rows(eval_rows, settings.eval_rows, settings.seed, tokenizer, Volume(settings.output_dir).evaluation_rows)


def needed(config: Config) -> bool:
    return bool(config.settings.eval_rows or config.settings.eval_tasks)


def run(config: Config, tracker: Any, telemetry: Any, benchmarks: tasks.Benchmarks | None = None) -> dict[str, Any] | None:
    """Score what FT_EVAL_ROWS and FT_EVAL_TASKS ask for, resuming; return the summary (None: nothing to evaluate)."""
    settings = config.settings
    volume = Volume(settings.output_dir)
    if not needed(config):
        return None
    benchmarks = benchmarks if benchmarks is not None else tasks.resolve(settings.eval_tasks)
    rows = own_task.kept_rows(volume.evaluation_rows)
    units = [(model, unit) for model in MODELS for unit in (["own_task"] if rows else []) + list(benchmarks.names)]
    key = _key(settings, benchmarks, rows)
    if (summary := read_json(volume.evaluation_summary, None)) and summary.get("key") == key:
        return summary  # a re-run after the gate or a failed registration: nothing left to evaluate
    telemetry.stage("evaluating")
    template = loading.load_tokenizer(settings).chat_template or ""  # the base's prompts, as the cache keys them
    started, done, spent = time.perf_counter(), {}, []
    for model in MODELS:
        todo = []
        for unit in [u for m, u in units if m == model]:
            result = _done(volume, settings, benchmarks, model, unit, key, template)
            if result is not None:
                done[(model, unit)] = result
            else:
                todo.append(unit)
        if not todo:
            continue
        net, tokenizer, folder = _load(config, volume, model)
        try:
            for unit in todo:
                begun = time.perf_counter()
                result = _evaluate(config, net, tokenizer, folder, benchmarks, rows, unit)
                result |= {"key": key, "seconds": round(time.perf_counter() - begun, 3)}
                write_json(_unit_path(volume, model, unit), result)
                if model == "base" and unit != "own_task":
                    base_scores.keep(_cache_dir(settings), unit, _cache_key(settings, benchmarks, unit, template), result)
                done[(model, unit)] = result
                spent.append(result["seconds"])
                _progress(model, unit, result, len(done), len(units), spent)
        finally:
            del net
            _free()
    summary = _summary(settings, benchmarks, rows, done, key, time.perf_counter() - started)
    write_json(volume.evaluation_summary, summary)
    _track(tracker, summary, done)
    print(compare.line(summary), flush=True)
    return summary


def gate(config: Config, summary: dict[str, Any] | None) -> RegressionFound | None:
    """FT_EVAL_MAX_REGRESSION: the refusal (exit 9) naming each benchmark that fell by more, or None to register."""
    limit = config.settings.eval_max_regression
    if summary and limit and (fell := compare.drops(summary["benchmarks"], limit)):
        return RegressionFound(
            f"the fine-tuned model is worse than the base model: {'; '.join(fell)}"
            + (f" ({compare.limit_words(summary['limit'])})" if summary["limit"] else "")
            + f". It is saved at {Volume(config.settings.output_dir).final_model} and was not registered. To register it anyway, re-run with "
            "FT_EVAL_MAX_REGRESSION=0 or a larger value (nothing is trained or evaluated again); to do better, change the data or the recipe "
            "and use a new FT_OUTPUT_DIR."
        )
    return None


def _key(settings: Any, benchmarks: tasks.Benchmarks, rows: list[dict]) -> str:
    """What a unit's result depends on besides the two models (which the volume's fingerprint already fixes)."""
    parts = {"tasks": benchmarks.identities, "limit": settings.eval_limit, "rows": [r["row"] for r in rows], "tokens": settings.eval_max_new_tokens}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _unit_path(volume: Volume, model: str, unit: str) -> str:
    return volume.evaluation_unit(model, unit)


def _cache_dir(settings: Any) -> str:
    return settings.eval_cache_dir or Volume(settings.output_dir).base_scores


def _cache_key(settings: Any, benchmarks: tasks.Benchmarks, unit: str, template: str) -> str:
    return base_scores.key(settings.model, settings.model_revision, benchmarks.identities[unit], settings.eval_limit, template)


def _done(volume: Volume, settings: Any, benchmarks: tasks.Benchmarks, model: str, unit: str, key: str, template: str) -> dict[str, Any] | None:
    """A unit an earlier attempt finished with these settings, or the base's scores from the cache."""
    result = read_json(_unit_path(volume, model, unit), None)
    if result and result.get("key") == key:
        return result
    if model == "base" and unit != "own_task":
        folder, cache_key = _cache_dir(settings), _cache_key(settings, benchmarks, unit, template)
        if (cached := base_scores.read(folder, unit, cache_key)) is not None:
            print(f"fulltune: evaluating: base model, {unit}: scores read from {base_scores.path(folder, unit, cache_key)} (not evaluated again)",
                  flush=True)
            cached |= {"key": key}
            write_json(_unit_path(volume, model, unit), cached)
            return cached
    return None


def _load(config: Config, volume: Volume, model: str) -> tuple[Any, Any, str]:
    """The model (in its serving precision, on this process's device), its tokenizer, and its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings, dtype = config.settings, config.precision.dtype("serving")
    if model == "tuned":
        folder = volume.final_model
        tokenizer = AutoTokenizer.from_pretrained(folder)
        net = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    else:
        folder = settings.model
        tokenizer = loading.load_tokenizer(settings)
        net = loading.load_model(settings, tokenizer, config.precision, dtype=dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if config.cuda else torch.device("cpu")
    return net.to(device).eval(), tokenizer, folder


def _evaluate(config: Config, net: Any, tokenizer: Any, folder: str, benchmarks: tasks.Benchmarks, rows: list[dict], unit: str) -> dict[str, Any]:
    settings = config.settings
    if unit == "own_task":
        answered = own_task.answer(net, tokenizer, rows, settings.eval_max_new_tokens, bf16=False)
        return {"scores": own_task.summary(answered), "rows": answered}
    results = harness.score(net, tokenizer, folder, unit, benchmarks.manager, settings.eval_limit, config.cuda, quiet=settings.log_level != "debug")
    return {"scores": harness.metrics(results), "higher_is_better": harness.higher_is_better(results), "lm_eval": results}


def _progress(model: str, unit: str, result: dict[str, Any], finished: int, total: int, spent: list[float]) -> None:
    scores = result["scores"]
    if unit == "own_task":
        shown = ", ".join(f"{m} {v:.3f}" for m, v in scores.items())
    else:  # a group's subtasks each by name
        shown = "; ".join(("" if t == unit else f"{t}: ") + ", ".join(f"{m} {v:.3f}" for m, v in ms.items()) for t, ms in scores.items())
    left = (total - finished) * sum(spent) / len(spent)
    print(f"fulltune: evaluating: {SHOWN[model]}, {unit.replace('_', ' ') if unit == 'own_task' else unit}: {shown} in {result['seconds']:.1f} s; "
          f"{finished} of {total} done" + (f", about {left:.0f} s left" if finished < total else ""), flush=True)


def _summary(settings: Any, benchmarks: tasks.Benchmarks, rows: list[dict], done: dict, key: str, seconds: float) -> dict[str, Any]:
    table = []
    for unit in benchmarks.names:
        base, tuned = done[("base", unit)], done[("tuned", unit)]
        table += compare.rows(base["scores"], tuned["scores"], tuned.get("higher_is_better", {}))
    summary: dict[str, Any] = {"key": key, "limit": settings.eval_limit, "benchmarks": table, "seconds": round(seconds, 2),
                               "unit_seconds": round(sum(r.get("seconds", 0.0) for r in done.values()), 2)}
    if rows:
        base, tuned = done[("base", "own_task")], done[("tuned", "own_task")]
        summary["own_task"] = {"rows": len(rows), "base": base["scores"], "tuned": tuned["scores"],
                               "examples": own_task.examples(base["rows"], tuned["rows"])}
    return summary


def _track(tracker: Any, summary: dict[str, Any], done: dict) -> None:
    """Into the job's MLflow run: the metrics, the tags, lm-eval's own results and the own-task answers."""
    artifacts = {"evaluation/summary.json": summary}
    for model in MODELS:
        results = {unit: r["lm_eval"] for (m, unit), r in done.items() if m == model and "lm_eval" in r}
        if results:
            artifacts[f"evaluation/lm-eval-{model}.json"] = results
    tracker.log(tags=compare.tags(summary), metrics=compare.metrics(summary), artifacts=artifacts)
    answers = [row | {"model": model} for (model, unit), r in done.items() if unit == "own_task" for row in r["rows"]]
    tracker.log_table(answers, "evaluation/own_task_answers.json")


def _free() -> None:
    gc.collect()
    _empty_device_cache()


def _empty_device_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def free_training_memory(trainer: Any) -> None:
    """Drop every reference the trainer and accelerate hold to the training model, its gradients and the optimizer
    state (on Qwen3-4B 48 GB of the GPU); `empty_device`, once the caller dropped the trainer, frees them."""
    trainer.accelerator.free_memory()  # accelerate's lists of prepared models, optimizers and schedulers
    for holder in (trainer, trainer.callback_handler):  # the callback handler keeps its own references, handed to every callback
        for name in ("model", "model_wrapped", "optimizer", "lr_scheduler"):
            if hasattr(holder, name):
                setattr(holder, name, None)


def empty_device() -> None:
    """The trainer dropped: its memory back, before the evaluation stage loads its models into an empty device."""
    collector.settle()  # the trainer and the model were frozen while training (trainer/core/collector.py): their cycles freed now
    _empty_device_cache()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # what the evaluation's models find taken (0 when nothing is left)
        print(f"fulltune: evaluation: {torch.cuda.memory_allocated() / 1e9:.2f} GB of GPU memory still allocated after training", flush=True)
