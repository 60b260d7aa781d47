"""FT_MIRROR_URL against a real S3-compatible server on loopback (moto's, tests/s3server.py) through AWS_ENDPOINT_URL:
the demo reads its data from s3:// and mirrors to s3://, is stopped, loses its volume and resumes from the bucket, and
keeps training while the bucket is down.  Real processes, signals, files and HTTP; the server is stopped for real."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import pytest
import xxhash
from s3server import SECRET_KEY, S3Server

from conftest import NO_EVALUATION, committed_steps, job_env, max_weight_difference, run_job, start_job, termination_message, wait_for, with_faults

pytestmark = pytest.mark.slow  # every test starts the demo job in a subprocess

STEPS = dict(FT_PRESET="demo", FT_MAX_STEPS="40", FT_SAVE_STEPS="10", FT_EVAL_STEPS="10", FT_SAVE_TOTAL_LIMIT="2", FT_BATCH_SIZE="4",
             FT_GRADIENT_ACCUMULATION_STEPS="2", **NO_EVALUATION)  # 8 sequences a step, not the preset's 64: what is mirrored, not how well it learns
DATA, BUCKET = "s3://fulltune-data/demo/train.jsonl", "fulltune-mirror"
DOWN, BACK = "not answering since", "back (down since"
FINAL_WEIGHTS = "final/model/model.safetensors"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from trainer.data import demo

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    fs = server.filesystem()
    fs.mkdir("fulltune-data")
    fs.mkdir(BUCKET)
    fs.pipe(DATA.removeprefix("s3://"), "".join(json.dumps(row) + "\n" for row in demo.conversations(400, seed=3)).encode())
    yield server
    if server.process.poll() is None:
        server.stop()


def mirror_env(s3: S3Server, out: Path, mirror: str, **more: str) -> dict[str, str]:
    return job_env(out, **STEPS, FT_DATASET=DATA, FT_MIRROR_URL=f"s3://{BUCKET}/{mirror}", **s3.env()) | more


def remote_manifests(s3: S3Server, mirror: str) -> dict[int, dict]:
    """step -> commit.json of each committed checkpoint the bucket holds."""
    fs, found = s3.filesystem(), {}
    for path in fs.glob(f"{BUCKET}/{mirror}/checkpoints/checkpoint-*/commit.json"):
        manifest = json.loads(fs.cat(path))
        found[manifest["step"]] = manifest
    return found


def assert_holds_the_volumes_checkpoints_and_final_model(s3: S3Server, mirror: str, out: Path) -> None:
    """Every committed checkpoint of the volume, and only those, is in the bucket with its manifest, each object's bytes
    matching the manifest's checksum; so is the final model."""
    fs, prefix = s3.filesystem(), f"{BUCKET}/{mirror}"
    remote = remote_manifests(s3, mirror)
    assert sorted(remote) == committed_steps(out)
    folders = [*(f"checkpoints/checkpoint-{step}" for step in remote), "final"]
    for folder in folders:
        manifest = json.loads(fs.cat(f"{prefix}/{folder}/commit.json"))
        for name, size in manifest["files"].items():
            data = fs.cat(f"{prefix}/{folder}/{name}")
            assert len(data) == size and xxhash.xxh3_128_hexdigest(data) == manifest["xxh3_128"][name], f"{folder}/{name}"
            assert data == (out / folder / name).read_bytes(), f"{folder}/{name}"
    assert json.loads(fs.cat(f"{prefix}/fingerprint.json")) == json.loads((out / ".fulltune" / "fingerprint.json").read_text())


def assert_no_secret(out: Path, *texts: str) -> None:
    """The secret key is in no log line, termination message, MLflow param (the store's database), run report or other file."""
    assert all(SECRET_KEY not in text for text in texts)
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET_KEY.encode() not in path.read_bytes(), path


@pytest.fixture(scope="module")
def straight(s3, tmp_path_factory):
    """The demo, uninterrupted, from s3:// data to an s3:// mirror: the weights every other run must end with."""
    out = tmp_path_factory.mktemp("straight") / "volume"
    env = mirror_env(s3, out, "straight")
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, env, result


def test_the_demo_reads_s3_data_and_the_bucket_holds_each_committed_checkpoint_with_its_manifest_and_the_final_model(s3, straight):
    out, env, result = straight
    assert f"train: FT_DATASET='{DATA}'" in result.stdout
    assert_holds_the_volumes_checkpoints_and_final_model(s3, "straight", out)
    assert committed_steps(out)[-2:] == [30, 40]  # retention: FT_SAVE_TOTAL_LIMIT=2 (and the best, here the newest)
    for step in (10, 20, 30, 40):  # each uploaded after its commit; the older ones then removed from the bucket as from the volume
        assert f"mirrored checkpoint at step {step}: s3://{BUCKET}/straight/checkpoints/checkpoint-{step}" in result.stdout
    assert result.stdout.index("mirrored the final model") < result.stdout.index("fulltune: summary exit=0")
    assert json.loads((out / ".fulltune" / "status.json").read_text())["mirrored"] == f"s3://{BUCKET}/straight"
    assert_no_secret(out, result.stdout, result.stderr, termination_message(env))


@pytest.fixture(scope="module")
def resumed(s3, straight, tmp_path_factory):
    """Stopped by SIGTERM once the bucket has a checkpoint, the volume deleted, restarted on an empty volume."""
    folder = tmp_path_factory.mktemp("resumed")
    out, log = folder / "volume", folder / "1.log"
    env = mirror_env(s3, out, "resumed")
    job = start_job(with_faults(env, seconds_per_step=0.5), log)
    wait_for(lambda: "mirrored checkpoint at step 10" in log.read_text() or job.poll() is not None, what="checkpoint 10 in the bucket")
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 75, log.read_text()
    stopped_at = max(committed_steps(out))
    shutil.rmtree(out)
    result = run_job(env)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, stopped_at, log.read_text(), result


def test_sigterm_exits_75_and_an_empty_volume_resumes_from_the_mirror_to_the_straight_runs_weights(s3, straight, resumed):
    out, stopped_at, first, result = resumed
    assert 10 <= stopped_at < 40, first
    assert f"mirrored checkpoint at step {stopped_at}:" in first  # the stop's checkpoint reached the bucket before exit 75
    url = f"s3://{BUCKET}/resumed/checkpoints/checkpoint-{stopped_at}"
    assert f"resuming from the mirror: {url} (" in result.stdout and "every file's xxh3_128 checksum verified" in result.stdout
    assert "starting from step 0" not in result.stdout
    assert max_weight_difference(straight[0] / FINAL_WEIGHTS, out / FINAL_WEIGHTS) == 0.0  # exact on CPU
    assert_holds_the_volumes_checkpoints_and_final_model(s3, "resumed", out)


@pytest.mark.faults("one byte changed in a mirrored checkpoint")
def test_a_damaged_object_in_the_mirror_is_found_by_its_checksum_and_the_checkpoint_before_it_is_resumed(s3, straight, resumed):
    fs = s3.filesystem()
    fs.copy(f"{BUCKET}/resumed", f"{BUCKET}/damaged", recursive=True)  # the finished mirror of `resumed`: checkpoints 30 and 40
    weights = f"{BUCKET}/damaged/checkpoints/checkpoint-40/model.safetensors"
    data = bytearray(fs.cat(weights))
    data[len(data) // 2] ^= 0x01
    fs.pipe(weights, bytes(data))
    out = resumed[0]  # the same FT_OUTPUT_DIR (the demo's FT_MODEL is under it), on an empty volume again
    shutil.rmtree(out)
    result = run_job(mirror_env(s3, out, "damaged"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("the mirror's checkpoint at step 40 is damaged, not resumed: model.safetensors does not match its xxh3_128 checksum"
            in result.stdout), result.stdout
    assert f"resuming from the mirror: s3://{BUCKET}/damaged/checkpoints/checkpoint-30 (" in result.stdout
    assert max_weight_difference(straight[0] / FINAL_WEIGHTS, out / FINAL_WEIGHTS) == 0.0
    assert_holds_the_volumes_checkpoints_and_final_model(s3, "damaged", out)  # checkpoint 40 uploaded anew, whole


@pytest.mark.faults("a mirror written by another configuration")
def test_a_mirror_of_another_configuration_exits_2_naming_the_setting_before_training(s3, straight, tmp_path):
    before = s3.filesystem().cat(f"{BUCKET}/straight/fingerprint.json")
    env = mirror_env(s3, tmp_path / "volume", "straight", FT_LEARNING_RATE="3e-3")
    result = run_job(env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"the checkpoints in s3://{BUCKET}/straight belong to a different configuration" in result.stderr
    assert "FT_LEARNING_RATE: '0.001' in the mirror, '0.003' now" in result.stderr and "Traceback" not in result.stderr
    assert "starting from step" not in result.stdout and "resuming" not in result.stdout
    assert s3.filesystem().cat(f"{BUCKET}/straight/fingerprint.json") == before


def test_an_empty_volume_resuming_from_a_mirror_whose_validation_rows_were_others_exits_2_naming_them(s3, straight, tmp_path):
    """The mirror's record holds what the data resolved to, as the volume's does: a resume onto an empty volume compares it
    once the data is prepared, instead of training on with checkpoints validated on other rows."""
    fs = s3.filesystem()
    fs.copy(f"{BUCKET}/straight", f"{BUCKET}/otherrows", recursive=True)
    recorded = json.loads(fs.cat(f"{BUCKET}/otherrows/fingerprint.json"))
    assert recorded["evaluation data"] == f"FT_EVAL_FRACTION=0.1 of FT_DATASET='{DATA}', seed 42"  # sent as the volume records it
    fs.pipe(f"{BUCKET}/otherrows/fingerprint.json", json.dumps(recorded | {"evaluation data": f"{DATA} [test]"}).encode())
    out = straight[0]  # the same FT_OUTPUT_DIR (the demo's FT_MODEL is under it) on an empty volume; the straight run's kept aside
    shutil.move(out, tmp_path / "aside")
    try:
        result = run_job(mirror_env(s3, out, "otherrows"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(tmp_path / "aside", out)
    assert result.returncode == 2, result.stdout + result.stderr
    now = f"FT_EVAL_FRACTION=0.1 of FT_DATASET='{DATA}', seed 42"
    assert f"evaluation data: '{DATA} [test]' on the volume, {now!r} now" in result.stderr
    assert "starting from step" not in result.stdout and "step=" not in result.stdout


@pytest.mark.faults("the bucket down mid-run")
def test_the_bucket_down_mid_run_costs_no_step_and_every_checkpoint_reaches_it_once_it_is_back(s3, tmp_path):
    out, log = tmp_path / "volume", tmp_path / "job.log"
    env = mirror_env(s3, out, "outage")
    job = start_job(with_faults(env, seconds_per_step=0.5), log)
    try:
        wait_for(lambda: "mirrored checkpoint at step 10" in log.read_text() or job.poll() is not None, what="checkpoint 10 in the bucket")
        s3.stop()
        wait_for(lambda: "committed checkpoint at step 30" in log.read_text() or job.poll() is not None, what="two commits while the bucket is down")
        s3.start()
        assert job.wait(timeout=300) == 0, log.read_text()
    finally:
        job.kill()
    text = log.read_text()
    assert text.count(DOWN) == text.count(BACK) == 1, text  # one line when it goes, one when it is back, however many uploads failed
    down, back = text.index(DOWN), text.index(BACK)
    assert re.search(r"not answering since step (10|20) ", text), text
    assert down < text.index("committed checkpoint at step 30") < back, text  # training went on meanwhile
    assert "step=30/40" in text[down:back]
    assert_holds_the_volumes_checkpoints_and_final_model(s3, "outage", out)
    assert_no_secret(out, text, termination_message(env))


@pytest.mark.faults("the bucket down past the end", "the bucket down at start")
def test_the_bucket_down_past_the_end_exits_8_keeping_the_model_and_a_retry_only_uploads(s3, tmp_path):
    out, log = tmp_path / "volume", tmp_path / "job.log"
    env = mirror_env(s3, out, "late", FT_MAX_STEPS="20", FT_MIRROR_WAIT_SECONDS="3")
    job = start_job(with_faults(env, seconds_per_step=0.5), log)
    try:
        wait_for(lambda: "mirrored checkpoint at step 10" in log.read_text() or job.poll() is not None, what="checkpoint 10 in the bucket")
        s3.stop()
        assert job.wait(timeout=300) == 8, log.read_text()

        # A new job while the bucket is still down: exit 1 within its few tries, before anything is trained.
        other = run_job(mirror_env(s3, tmp_path / "other", "late"))
        assert other.returncode == 1, other.stdout + other.stderr
        assert f"FT_MIRROR_URL=s3://{BUCKET}/late: the object store does not answer" in other.stderr and "Traceback" not in other.stderr
        assert "starting from step" not in other.stdout
    finally:
        job.kill()
        if s3.process.poll() is not None:
            s3.start()
    text = log.read_text()
    assert f"the model is trained and saved at {out}/final" in text and f"FT_MIRROR_URL=s3://{BUCKET}/late has not received" in text
    assert "FT_MIRROR_WAIT_SECONDS=3" in text and "exit 8" in termination_message(env)
    assert (out / "final" / "model" / "model.safetensors").exists() and committed_steps(out) == [10, 20]
    assert "mirrored" not in json.loads((out / ".fulltune" / "status.json").read_text())

    retry = run_job(env)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert "starting from step" not in retry.stdout and "resuming" not in retry.stdout  # no training: only the uploads
    assert "mirrored checkpoint at step 20" in retry.stdout and "mirrored the final model" in retry.stdout
    assert_holds_the_volumes_checkpoints_and_final_model(s3, "late", out)
    assert_no_secret(out, text, retry.stdout, retry.stderr, termination_message(env))
