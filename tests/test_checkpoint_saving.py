"""Saves in the background (trainer/checkpointing/saving.py): training waits for the snapshot only, the checkpoint
counts once its background write is committed, and FT_SAVE_EVERY_MINUTES adds saves at evaluation steps."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from conftest import committed_steps, wait_for
from trainer.checkpointing import commits, manifest, saving
from trainer.checkpointing.costs import Costs
from trainer.core import settings
from trainer.core.errors import ConfigError


@pytest.fixture
def tiny_trainer(tmp_path):
    """A plain Trainer on a tiny random Qwen3 after one optimizer step (AdamW's states exist)."""
    import torch
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    net = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, tie_word_embeddings=True, **shape))
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3, 4] * 4] * 2, "labels": [[1, 2, 3, 4] * 4] * 2})
    saver = commits.CommitCheckpoints(keep=5)
    out = tmp_path / "volume" / "checkpoints"
    trainer = Trainer(model=net, train_dataset=rows, callbacks=[saver], args=TrainingArguments(
        output_dir=str(out), max_steps=1, save_strategy="no", per_device_train_batch_size=1, report_to=[], use_cpu=True, disable_tqdm=True))
    trainer.train()
    return trainer, saver, tmp_path / "volume"


def test_a_save_returns_before_its_slow_write_and_counts_only_once_committed(tiny_trainer, monkeypatch):
    trainer, saver, volume = tiny_trainer
    original = saving.write_snapshot
    writing, volume_answers = volume.parent / "writing", volume.parent / "volume-answers"

    def slow(*args):  # a volume that holds the write until the test lets it go
        writing.touch()
        began = time.monotonic()
        while not volume_answers.exists() and time.monotonic() - began < 60:
            time.sleep(0.05)
        original(*args)

    monkeypatch.setattr(saving, "write_snapshot", slow)
    trainer.state.global_step = 7
    saving.save(trainer, None, saver.saves, saver._commit)  # returns while the write is held (no timing: it cannot pass by luck)
    wait_for(writing.exists, timeout=60, what="the write to start")
    assert saver.saves.in_flight and committed_steps(volume) == []  # in flight, and not counted while it is being written
    volume_answers.touch()
    saver.saves.wait()
    assert committed_steps(volume) == [7]
    assert manifest.damage(str(volume / "checkpoints" / "checkpoint-7")) is None
    assert 0 < saver.costs.last < saver.costs.background[-1]  # what training waited for is less than the write it did not wait for
    folder = volume / "checkpoints" / "checkpoint-7"
    assert (folder / "training_args.json").exists() and not (folder / "training_args.bin").exists()


def test_the_snapshot_is_the_state_at_the_save_not_after_it(tiny_trainer, monkeypatch):
    """Weights changed while the write is in flight (the next optimizer steps) do not reach the checkpoint."""
    import torch
    from safetensors.torch import load_file

    trainer, saver, volume = tiny_trainer
    original = saving.write_snapshot
    monkeypatch.setattr(saving, "write_snapshot", lambda *a: (time.sleep(1), original(*a)))
    expected = trainer.model.model.embed_tokens.weight.detach().clone()
    trainer.state.global_step = 3
    saving.save(trainer, None, saver.saves, saver._commit)
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.add_(1.0)
    saver.saves.wait()
    saved = load_file(volume / "checkpoints" / "checkpoint-3" / "model.safetensors")
    assert torch.equal(saved["model.embed_tokens.weight"], expected)


def test_an_error_in_the_background_write_is_raised_at_the_next_wait(tiny_trainer, monkeypatch):
    trainer, saver, volume = tiny_trainer

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saving, "write_snapshot", full)
    trainer.state.global_step = 4
    saving.save(trainer, None, saver.saves, saver._commit)
    with pytest.raises(OSError, match="No space left"):
        saver.saves.wait()
    assert committed_steps(volume) == []


def test_save_every_minutes_saves_at_the_first_evaluation_step_after_the_interval():
    saver = commits.CommitCheckpoints(keep=2, every_minutes=1 / 60)  # one second
    args = SimpleNamespace(eval_steps=5, save_steps=1000)

    def due(step: int) -> bool:
        control = SimpleNamespace(should_save=False)
        saver.on_step_end(args, SimpleNamespace(global_step=step, max_steps=1000), control)
        return control.should_save

    saver.cadence.last_save = time.monotonic()
    assert not due(5)  # the interval has not passed
    saver.cadence.last_save -= 2
    assert not due(6)  # passed, but not an evaluation step
    assert due(10)
    off = commits.CommitCheckpoints(keep=2)  # FT_SAVE_EVERY_MINUTES=0: by FT_SAVE_STEPS only
    off.cadence.last_save -= 3600
    control = SimpleNamespace(should_save=False)
    off.on_step_end(args, SimpleNamespace(global_step=10, max_steps=1000), control)
    assert not control.should_save


def test_a_negative_save_interval_exits_2_naming_the_variable():
    with pytest.raises(ConfigError, match="FT_SAVE_EVERY_MINUTES"):
        settings.load({"FT_PLATFORM": "none", "FT_SAVE_EVERY_MINUTES": "-1"})


def test_the_cost_of_a_save_counts_the_steps_that_ran_slower_beside_its_write():
    """Blocked 0.1 s, then two steps beside the write at 3 s against clean steps of 1 s: it cost 4.1 s, not 0.1."""
    costs = Costs(began=time.perf_counter() - 20)
    for seconds in (1.2, 1.0, 0.9, 1.0):
        costs.step(seconds, overlapped=False)
    costs.blocked.append(0.1)
    for seconds, overlapped in ((3.0, True), (3.0, True), (1.0, False)):
        costs.step(seconds, overlapped)
    assert costs.clean_step == 1.0
    assert costs.overhead == pytest.approx(4.1)
    assert costs.overhead_share == pytest.approx(4.1 / 20, rel=0.01) and costs.share == pytest.approx(0.1 / 20, rel=0.01)
    assert costs.summary()["checkpoint_overhead_total_s"] == pytest.approx(4.1)
    first = Costs(began=time.perf_counter() - 5, blocked=[0.2], steps=[(2.0, True)])
    assert first.overhead == pytest.approx(0.2)  # no clean step yet: nothing to compare with


def test_the_job_reports_what_the_steps_beside_a_background_write_lost_not_only_the_time_blocked(tmp_path):
    """A write held 6 s, and each step beside it 1.5 s slower (tests/faults: what copy-on-write faults and a writer on
    the same cores cost a loaded machine): the job's cost line, MLflow and the run report count those seconds."""
    import mlflow

    from conftest import job_env, run_job, with_faults
    from trainer.console import progress

    out, writing = tmp_path / "volume", tmp_path / "writing"
    env = job_env(out, FT_PRESET="demo", FT_MAX_STEPS="12", FT_SAVE_STEPS="4", FT_EVAL_STEPS="4", FT_SAVE_TOTAL_LIMIT="2", FT_REGISTERED_MODEL="",
                  FT_BATCH_SIZE="1", FT_GRADIENT_ACCUMULATION_STEPS="1", FT_EVAL_ROWS="0", FT_EVAL_SAMPLES="0")  # short steps: 1.5 s stands out
    result = run_job(with_faults(env, slow_checkpoint_write=f"4:6:{writing}", slow_steps_while_writing="1.5"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [progress.parse_line(line) for line in result.stdout.splitlines() if "checkpoint_blocked_s=" in line]
    assert [line["step"] for line in lines] == ["4/12", "8/12", "12/12"]
    assert float(lines[-1]["checkpoint_overhead_share"]) > float(lines[-1]["checkpoint_blocked_share"]) + 0.01

    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow/mlflow.db")
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    blocked, overhead = run.data.metrics["checkpoint_blocked_total_s"], run.data.metrics["checkpoint_overhead_total_s"]
    assert overhead - blocked >= 1.5  # at least one step beside checkpoint 4's held write (about four, at 1.5 s each)
    assert "checkpoint_overhead_total_s" in (out / "report.html").read_text()


def test_on_cpu_training_steps_on_one_thread_fewer_while_a_write_runs_and_gets_it_back_after(tiny_trainer, monkeypatch):
    """The writer gets a core of its own (saving.WriterCore): training's threads no longer wait on it at every operation."""
    import torch

    trainer, saver, volume = tiny_trainer
    original, threads = saving.write_snapshot, torch.get_num_threads()
    release, seen = volume.parent / "release", []

    def held(*args):
        seen.append(True)
        wait_for(release.exists, timeout=60, what="the test to release the write")
        original(*args)

    monkeypatch.setattr(saving, "write_snapshot", held)
    torch.set_num_threads(2)
    try:
        trainer.state.global_step = 8
        saving.save(trainer, None, saver.saves, saver._commit)
        wait_for(lambda: seen, timeout=60, what="the write to start")
        assert torch.get_num_threads() == 1
        saver.saves.between_steps()
        assert torch.get_num_threads() == 1  # still writing: the core stays the writer's
        release.touch()
        wait_for(lambda: not saver.saves.in_flight, timeout=60, what="the write to end")
        saver.saves.between_steps()
        assert torch.get_num_threads() == 2 and committed_steps(volume) == [8]
        gpu = saving.Saves(pinned=True)  # a GPU job's threads only feed the device
        gpu._core.give()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_training_takes_the_core_back_while_the_write_only_waits_for_the_disk(tiny_trainer, monkeypatch):
    """The flush waits on the disk, not a core: once every file is written and checksummed, the next step gets its
    thread back, while the checkpoint still counts only once flushed (manifest.commit's `read`, saving.Saves.flushing)."""
    import os

    import torch

    trainer, saver, volume = tiny_trainer
    threads, fsync = torch.get_num_threads(), os.fsync
    release, flushing = volume.parent / "release", []

    def held(fd):  # a disk that holds the flush until the test lets it go
        flushing.append(fd)
        wait_for(release.exists, timeout=60, what="the test to release the flush")
        fsync(fd)

    monkeypatch.setattr(manifest.os, "fsync", held)
    torch.set_num_threads(2)
    try:
        trainer.state.global_step = 9
        saving.save(trainer, None, saver.saves, saver._commit)
        wait_for(lambda: flushing, timeout=60, what="the flush to start")
        assert saver.saves.in_flight and torch.get_num_threads() == 1
        saver.saves.between_steps()
        assert torch.get_num_threads() == 2  # flushing: the core is training's again
        assert committed_steps(volume) == []  # not counted before it is on the disk
        release.touch()
        saver.saves.wait()
        assert committed_steps(volume) == [9] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
