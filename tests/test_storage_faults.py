"""Storage that fails under the job: a volume that fills up (exit 6) and checkpoint bytes damaged on the volume.

The full volume is a real one: a small tmpfs mounted by the test (root only; CI runs as root), filled by a file
that is not the job's at a known moment (tests/faults), so the save after it meets a real ENOSPC.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import NO_EVALUATION, committed_steps, job_env, max_weight_difference, run_job, termination_message, with_faults
from trainer.checkpointing import commits as checkpoints
from trainer.checkpointing import manifest
from trainer.core import files

STEPS = dict(FT_PRESET="demo", FT_MAX_STEPS="8", FT_SAVE_STEPS="2", FT_EVAL_STEPS="2", FT_SAVE_TOTAL_LIMIT="2", FT_SYSTEM_METRICS="false", **NO_EVALUATION)
# The demo's checkpoint is 5.4 MB (1.8 MB weights, 3.6 MB AdamW states), its final model 1.8 MB: leaving half of
# each free lets the weights of the checkpoint be written and its optimizer file fail, and the final model fail.
LEFT_FOR_THE_CHECKPOINT = 2_500_000
LEFT_FOR_THE_FINAL_MODEL = 900_000


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The final weights of the same job run without any fault."""
    out = tmp_path_factory.mktemp("straight") / "volume"
    result = run_job(job_env(out, **STEPS))
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "final" / "model" / "model.safetensors"


@pytest.fixture
def small_volume(tmp_path) -> Path:
    """A 64 MiB tmpfs: room for the demo job (about 16 MB) until the test's filler takes the rest."""
    mount = tmp_path / "small-volume"
    mount.mkdir()
    if os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("mounting a small tmpfs needs root (CI runs as root and must run this test)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs at {mount} (as uid {os.geteuid()}): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def only_one_line_of_exit_6(result: subprocess.CompletedProcess, env: dict[str, str], volume: Path) -> str:
    assert result.returncode == 6, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("fulltune: exit 6:")]
    assert line.startswith(f"fulltune: exit 6: volume full: {volume} has ") and " bytes free " in line
    assert "Free space on the volume (or mount a bigger one), then run the job again: it resumes from the last committed checkpoint." in line
    assert termination_message(env).startswith("exit 6: volume full: ")
    # The lease is released although its lock's few bytes no longer fit: left behind, the retry would wait out a lease period.
    assert not {"lease.json", "lease.lock"} & {p.name for p in (volume / ".fulltune").iterdir()}
    return line


def nothing_registered_or_saved(volume: Path) -> None:
    assert not (volume / "final").exists()
    assert not (volume / ".fulltune" / "status.json").exists()  # neither saved nor registered


@pytest.mark.slow
@pytest.mark.faults("a volume full during a checkpoint save")
def test_a_full_volume_during_a_checkpoint_exits_6_keeping_the_last_one_and_after_making_room_ends_like_a_straight_run(small_volume, straight):
    volume, filler = small_volume / "volume", small_volume / "filler"
    env = job_env(volume, **STEPS) | {"FT_TERMINATION_MESSAGE_PATH": str(small_volume.parent / "termination-log")}  # not on the full volume
    result = run_job(with_faults(env, fill_volume=f"{filler}:{LEFT_FOR_THE_CHECKPOINT}", fill_volume_at="2"))

    line = only_one_line_of_exit_6(result, env, volume)
    last = volume / "checkpoints" / "checkpoint-2"
    needed = manifest.committed_bytes(str(last))
    assert needed > LEFT_FOR_THE_CHECKPOINT  # the test's premise: the next checkpoint cannot fit
    assert f"the checkpoint at step 4 needs about {needed:,} bytes" in line  # as much as the last committed one
    assert f"Kept: every committed checkpoint, the newest {last}" in line
    assert committed_steps(volume) == [2] and manifest.damage(str(last)) is None  # intact, every checksum matches
    (aside,) = (volume / "incomplete").iterdir()
    assert re.fullmatch(r"checkpoint-4\.volume-full\.\d+", aside.name) and f"the partial checkpoint-4 is set aside in {aside}" in line
    assert (aside / "model.safetensors").exists() and not (aside / "commit.json").exists()  # kept, never committed
    nothing_registered_or_saved(volume)

    filler.unlink()  # the room a person makes: the file was not the job's
    retry = run_job(env)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert f"resuming from {last}\n" in retry.stdout
    assert max_weight_difference(volume / "final" / "model" / "model.safetensors", straight) == 0.0


@pytest.mark.slow
@pytest.mark.faults("a volume full during the final save")
def test_a_full_volume_during_the_final_save_exits_6_and_after_making_room_saves_the_straight_runs_model(small_volume, straight):
    volume, filler = small_volume / "volume", small_volume / "filler"
    env = job_env(volume, **STEPS) | {"FT_TERMINATION_MESSAGE_PATH": str(small_volume.parent / "termination-log")}  # not on the full volume
    result = run_job(with_faults(env, fill_volume=f"{filler}:{LEFT_FOR_THE_FINAL_MODEL}", fill_volume_at="final"))

    line = only_one_line_of_exit_6(result, env, volume)
    last = volume / "checkpoints" / "checkpoint-8"
    weights = os.path.getsize(last / "model.safetensors")  # fp32, as the final model on CPU
    assert weights > LEFT_FOR_THE_FINAL_MODEL
    assert (
        re.search(r"the final model needs about ([\d,]+) bytes", line)
        and abs(int(re.search(r"about ([\d,]+)", line)[1].replace(",", "")) - weights) < 0.01 * weights
    )
    assert f"Kept: every committed checkpoint, the newest {last} (a retry resumes there and saves the final model again)" in line
    assert committed_steps(volume)[-1] == 8 and manifest.damage(str(last)) is None
    nothing_registered_or_saved(volume)

    filler.unlink()
    retry = run_job(env)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert f"resuming from {last}\n" in retry.stdout and not (volume / "final.partial").exists()
    assert max_weight_difference(volume / "final" / "model" / "model.safetensors", straight) == 0.0
    assert json.loads((volume / ".fulltune" / "status.json").read_text())["registered"].endswith("/1")


def flip_one_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)  # inside a tensor, past the header
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate_to_half(path: Path) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damaged", "damage", "reported"),
    [
        ("model.safetensors", flip_one_byte, "model.safetensors does not match its xxh3_128 checksum recorded at commit (its bytes changed)"),
        ("optimizer.pt", truncate_to_half, "optimizer.pt has {half} bytes, {size} at commit (truncated)"),
    ],
    ids=["a flipped byte in the weights", "a truncated optimizer file"],
)
@pytest.mark.faults
def test_a_damaged_newest_checkpoint_is_set_aside_naming_the_file_and_the_job_resumes_from_the_one_before(tmp_path, straight, damaged, damage, reported):
    volume = tmp_path / "volume"
    env = job_env(volume, **STEPS)
    stopped = run_job(with_faults(env, sigterm_at_step="6"))
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    assert committed_steps(volume) == [4, 6]
    newest = volume / "checkpoints" / "checkpoint-6"
    size = os.path.getsize(newest / damaged)
    damage(newest / damaged)
    assert manifest.is_committed(str(newest)) == (damaged == "model.safetensors")  # a flipped byte keeps the size

    retry = run_job(env)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    (aside,) = (volume / "incomplete").iterdir()
    warning = f"fulltune: warning: checkpoint at step 6 is damaged, not resumed: {reported.format(half=size // 2, size=size)}; moved to {aside}"
    assert warning in retry.stdout
    assert f"resuming from {volume / 'checkpoints' / 'checkpoint-4'}\n" in retry.stdout
    assert re.fullmatch(r"checkpoint-6\.damaged\.\d+", aside.name) and (aside / damaged).exists()  # kept as found, never deleted
    assert max_weight_difference(volume / "final" / "model" / "model.safetensors", straight) == 0.0  # nothing trained on the damaged state


def test_a_manifest_without_checksums_does_not_count_and_the_checkpoint_is_set_aside(tmp_path, capsys):
    folder = tmp_path / "checkpoints" / "checkpoint-3"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "commit.json").write_text(json.dumps({"step": 3, "files": {"model.safetensors": 7}, "committed_at": 0}))

    assert not manifest.is_committed(str(folder))
    assert checkpoints.latest_for_resume(str(tmp_path / "checkpoints"), str(tmp_path / "incomplete")) is None
    assert "checkpoint at step 3 was never committed (save cut short)" in capsys.readouterr().out
    assert [p.name.split(".")[0] for p in (tmp_path / "incomplete").iterdir()] == ["checkpoint-3"]


def test_sample_answers_appended_on_a_full_volume_keep_every_earlier_line_whole(small_volume):
    """eval-samples.jsonl grows at every evaluation: when the volume fills during an append, the earlier answers stay
    as they were (whole JSON lines), and no half-written copy is left behind."""
    path = small_volume / "eval-samples.jsonl"
    files.append_lines(str(path), [json.dumps({"step": 0, "answer": "river apple"})])
    filler = small_volume / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(small_volume).free - (64 << 10)))  # 64 KiB left
    with pytest.raises(OSError):
        files.append_lines(str(path), [json.dumps({"step": 20, "answer": "x" * (1 << 20)})])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 0, "answer": "river apple"}]
    assert sorted(p.name for p in small_volume.iterdir()) == ["eval-samples.jsonl", "filler"]
