"""The output volume: a job that cannot write it stops at once; what it writes, other uids can read.

The tests run as root, which may write anything: the cases that need another user run in a forked
process that has dropped to uid 65534 (nobody), or, for files, copy them as that uid.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import NO_EVALUATION, ROOT, job_env, run_job
from trainer.core import permissions
from trainer.core.errors import ConfigError

NOBODY = 65534


def as_uid(uid: int, function, *args) -> str | None:
    """Run function(*args) in a forked child running as `uid`; return the exception it raised, as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            function(*args)
            outcome = b""
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(error).__name__}: {error}".encode()
        os.write(write, outcome)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    return outcome or None


@pytest.fixture
def shared_tmp():
    """A temporary folder every uid can enter (pytest's own tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="fulltune-volume-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.faults("a volume the job's user cannot write")
def test_a_volume_the_jobs_user_cannot_write_is_refused_naming_the_folder_the_uid_and_the_fix(shared_tmp):
    output = shared_tmp / "output"
    output.mkdir(mode=0o755)  # owned by root, as a host folder or a fresh PersistentVolume often is
    error = as_uid(NOBODY, permissions.check_writable, str(output))
    assert error and error.startswith("ConfigError: "), error
    for expected in (str(output), f"uid {NOBODY}", "fsGroup", "docker run --user", f"chown {NOBODY}"):
        assert expected in error, expected


def test_a_writable_volume_passes_and_keeps_no_trace_and_a_missing_folder_is_created(shared_tmp):
    shared_tmp.chmod(0o777)
    output = shared_tmp / "run1" / "output"
    assert as_uid(NOBODY, permissions.check_writable, str(output)) is None
    assert output.is_dir() and list(output.iterdir()) == []


@pytest.mark.faults("an output folder that cannot be created")
def test_entrypoint_exits_2_within_seconds_when_the_output_folder_cannot_be_created(tmp_path):
    (tmp_path / "not-a-folder").write_text("")
    env = job_env(tmp_path / "not-a-folder" / "output", FT_PRESET="demo")
    started = time.monotonic()
    result = run_job(env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 10
    assert f"FT_OUTPUT_DIR={tmp_path}/not-a-folder/output cannot be a folder: {tmp_path}/not-a-folder is a file" in result.stderr
    assert "write access" not in result.stderr and "chown" not in result.stderr, "no permission can help: the advice is about the file"
    assert "Traceback" not in result.stderr


@pytest.mark.faults("FT_OUTPUT_DIR naming a file")
def test_an_output_dir_that_is_a_file_is_refused_saying_so():
    with tempfile.NamedTemporaryFile() as file, pytest.raises(ConfigError) as refused:
        permissions.check_writable(file.name)
    assert str(refused.value) == (f"FT_OUTPUT_DIR={file.name} cannot be a folder: {file.name} is a file. Point FT_OUTPUT_DIR at a folder "
                                  "(the mounted volume; a missing one is created) or move the file away")


@pytest.mark.faults("a volume even root cannot write")
@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and util-linux's setpriv to take root's file-permission override away")
def test_a_volume_root_cannot_write_is_refused_without_advising_to_give_uid_0_access(shared_tmp):
    output = shared_tmp / "output"
    output.mkdir(mode=0o755)
    os.chown(output, NOBODY, NOBODY)  # owned by another uid, as on an NFS export that squashes root
    probe = f"from trainer.core import permissions\npermissions.check_writable({str(output)!r})"
    # uid 0 without CAP_DAC_OVERRIDE: what a root-squashed NFS mount or `--cap-drop ALL` leaves of root
    result = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--", sys.executable, "-c", probe],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "ConfigError" in result.stderr, result.stderr
    assert f"FT_OUTPUT_DIR={output} is not writable although this process runs as root (uid 0)" in result.stderr
    assert f"owned by uid {NOBODY}" in result.stderr and "root squash" in result.stderr and f"--user {NOBODY}:{NOBODY}" in result.stderr
    assert "Give uid 0" not in result.stderr


def _modes(folder: Path) -> set[tuple[str, str]]:
    return {("dir" if p.is_dir() else "file", stat.filemode(p.stat().st_mode)) for p in [folder, *folder.rglob("*")]}


@pytest.mark.slow
def test_the_final_model_and_checkpoints_are_readable_by_another_uid(shared_tmp):
    out = shared_tmp / "volume"
    env = job_env(out, FT_PRESET="demo", FT_MAX_STEPS="4", FT_SAVE_STEPS="2", FT_EVAL_STEPS="2", FT_REGISTERED_MODEL="", **NO_EVALUATION)
    previous = os.umask(0o022)  # the usual umask, inherited by the job
    try:
        result = run_job(env)
    finally:
        os.umask(previous)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Invalid value for environment variable" not in result.stderr  # libgomp, about OMP_NUM_THREADS
    saved = [out / "final" / "model", out / "checkpoints" / "checkpoint-4"]
    for folder in saved:
        assert _modes(folder) == {("dir", "drwxr-xr-x"), ("file", "-rw-r--r--")}, folder

    # A serving pod or a copy job under another uid: it can copy every file, and the copy loads.
    copies = shared_tmp / "copies"
    copies.mkdir()
    shutil.chown(copies, NOBODY, NOBODY)
    for folder in saved:
        copy = subprocess.run(["cp", "-r", str(folder), str(copies / folder.name)], user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True)
        assert copy.returncode == 0, copy.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(copies / "model")
    assert model.num_parameters() > 0 and AutoTokenizer.from_pretrained(copies / "model").chat_template


def test_a_read_only_mount_is_told_to_mount_it_read_write_not_to_chown_it(tmp_path):
    """A real read-only tmpfs, mounted in a private mount namespace (root, as the image's tests run)."""
    mounted = tmp_path / "volume"
    mounted.mkdir()
    env = job_env(mounted / "out")
    script = f"mount -t tmpfs -o ro none {mounted} && exec {sys.executable} {ROOT / 'entrypoint.py'}"
    try:
        result = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if result.stderr.startswith(("mount:", "unshare:")):
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"exit 2: FT_OUTPUT_DIR={mounted / 'out'} is on a read-only mount" in result.stderr and "drop `:ro`" in result.stderr
    assert "chown" not in result.stderr and "fsGroup" not in result.stderr and "Traceback" not in result.stderr
