"""The benchmark measures the job users run, and compares variants only from interleaved runs."""

from __future__ import annotations

from bench import child, synthetic
from bench import run as bench_run


def test_bench_fulltune_variant_trains_the_jobs_own_trainer(tmp_path, monkeypatch):
    import trl

    from trainer import job
    from trainer.checkpointing import commits as checkpoints
    from trainer.model import attention, memory, recipe, sharding
    from trainer.tracking import progress
    from trainer.tracking import run as tracking

    synthetic.build(str(tmp_path), rows=40, mean_tokens=48, gpu=False, config_path="", vocab=300)
    args = bench_run.parse(["--steps", "2", "--eval-steps", "1", "--no-mlflow", "--work", str(tmp_path)])
    built = []

    def build_trainer(*a, **kw):
        built.append(original(*a, **kw))
        return built[-1]

    original = job.build_trainer
    monkeypatch.setattr(job, "build_trainer", build_trainer)
    config = child.fulltune_config(args, str(tmp_path), "fulltune", {}, cuda=False)
    plan = memory.preflight(config)
    expected = recipe.sft_config(config.settings, config.precision, plan, cuda=False).to_dict()  # before the Trainer: it resets accelerate's state
    timer = child._timer(0.0)
    trainer = child.fulltune(config, timer)

    assert built == [trainer], "bench/child.py must build the fulltune variant with trainer.job.build_trainer"
    assert isinstance(trainer, trl.SFTTrainer) and type(trainer) is sharding.trainer_class(config.cuda, plan.strategy)  # the job's class
    callbacks = trainer.callback_handler.callbacks
    for kind in (checkpoints.CommitCheckpoints, progress.Progress, tracking.MetricsCallback):
        assert any(isinstance(c, kind) for c in callbacks), kind
    assert timer in callbacks
    assert trainer.args.to_dict() == expected
    assert trainer.data_collator.padding_free and trainer.model.config._attn_implementation == attention.register()

    trainer.train()
    assert trainer.state.global_step == 2 and timer.train_s > 0


def _run(round_: int, wall: float) -> dict:
    return {"round": round_, "wall_s": wall, "tokens_per_s": 1000 / wall, "losses": [2.0, 1.9], "layout": "8x1", "load_avg": [1.0, 1.0], "overrides": {}}


def test_ratio_only_from_interleaved_rounds_and_min_median_per_variant():
    args = bench_run.parse(["--rounds", "2", "--steps", "2"])
    one_round = {"literal": [_run(1, 100.0)], "fulltune": [_run(1, 50.0)]}
    text = bench_run.table(args, [], {}, one_round, [])
    assert "fulltune / literal" not in text and "No ratio" in text

    two_rounds = {"literal": [_run(1, 100.0), _run(2, 120.0)], "fulltune": [_run(1, 50.0), _run(2, 70.0)]}
    text = bench_run.table(args, [], {}, two_rounds, [])
    wall = next(line for line in text.splitlines() if line.startswith("| end-to-end wall"))
    assert wall == "| end-to-end wall (s) | 100.0 / 110.0 | 50.0 / 60.0 | 0.50 · 0.55 · 0.50, 0.58 |"
    speed = next(line for line in text.splitlines() if line.startswith("| training tokens/s"))
    assert "| 10 / 9 | 20 / 17 |" in speed  # rates: max / median
