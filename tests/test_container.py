"""The image, run for real: exit codes, signals, the volume and the Kubernetes pod's settings, in containers.

How to run these tests and which image they use: tests/containers.py.  Two full demo jobs run here: the
Kubernetes pod's (uninterrupted, the reference) and one started as the README's `docker run` line,
stopped and resumed; the other containers end in seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import containers
import pytest
from containers import Container
from deploy_files import REPO, one, render
from safetensors.torch import load_file

from conftest import committed_steps, wait_for

pytestmark = [pytest.mark.container, pytest.mark.slow]

# One thread: the demo model gains nothing from a second one and loses much on a busy machine (100 steps:
# 5 s instead of 20 with a second job on the cores).  The training process must get it, not "None".
DEMO = {"FT_PRESET": "demo", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "FT_BATCH_SIZE": "4", "FT_GRADIENT_ACCUMULATION_STEPS": "2"}  # short steps
# Long enough that a stop sent after the first checkpoint lands while the job still trains: 80 more
# steps, at least 4 s on a fast idle machine (0.05 s a step), where the stop takes well under 1 s.
STEPS = {"FT_MAX_STEPS": "100", "FT_SAVE_STEPS": "20", "FT_EVAL_STEPS": "20"}
OTHER_UID = 65534  # nobody: neither root nor the image's user
HOST_UID = 1000  # a host user's uid, as `docker run --user "$(id -u):$(id -g)"` passes it; not in the image's /etc/passwd


@pytest.fixture(scope="module", autouse=True)
def image():
    containers.require_image()
    yield
    containers.remove_all()  # what a failed test left running


@pytest.fixture(scope="module")
def say(request):
    """Print a measured number in the test run's output, captured or not."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"container: {line}")

    return say


@pytest.fixture(scope="module")
def shared():
    """A folder every uid can enter (pytest's tmp_path is private), for volumes read back as another uid."""
    folder = Path(tempfile.mkdtemp(prefix="fulltune-container-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def image_volume(folder: Path) -> Path:
    """A host folder prepared for the image's own user, as the README says: owned by it."""
    return containers.volume(folder, containers.image_user())


# -- The Kubernetes pod: the reference job ---------------------------------------------------------


@pytest.fixture(scope="module")
def pod():
    """The generic overlay's Job as the kubelet would start it: its settings, and its security context as flags.

    The demo preset stands in for the reference model and data, which CI cannot download (as in
    tests/test_k8s.py); the Secrets are optional and absent."""
    objects = render(REPO / "k8s" / "overlays" / "generic")
    spec = one(objects, "Job")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = dict(one(objects, "ConfigMap")["data"])
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            assert variable["valueFrom"]["secretKeyRef"]["optional"], variable["name"]
    for name in ("FT_MODEL", "FT_DATASET"):
        env.pop(name)
    pod_security, security = spec["securityContext"], container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True  # every container here runs read-only, /tmp on a tmpfs
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/output", "/tmp", "/dev/shm"} and env["FT_OUTPUT_DIR"] == "/output"
    flags = ["--user", f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}", "--group-add", str(pod_security["fsGroup"])]
    assert security["capabilities"] == {"drop": ["ALL"]} and security["allowPrivilegeEscalation"] is False
    flags += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    return {"env": env | DEMO | STEPS, "flags": tuple(flags), "fs_group": pod_security["fsGroup"]}


def pod_volume(folder: Path, fs_group: int) -> Path:
    """A PersistentVolume as the kubelet hands it to a pod with an fsGroup: group-owned, group-writable, setgid."""
    return containers.volume(folder, (0, fs_group), 0o2775)


@pytest.fixture(scope="module")
def reference(pod, shared, say):
    """The pod's job, uninterrupted: the Kubernetes case, and the weights a resumed job must end with."""
    out = pod_volume(shared / "reference", pod["fs_group"])
    log = shared / "reference.log"
    started = time.monotonic()
    code = containers.run(out, pod["env"], log, flags=pod["flags"])
    say(f"demo job, {STEPS['FT_MAX_STEPS']} steps, as the Kubernetes pod: {time.monotonic() - started:.1f} s in the container, exit {code}")
    return code, out, log.read_text()


def test_the_kubernetes_pods_settings_and_security_context_run_the_demo_to_exit_0(reference):
    code, out, log = reference
    assert code == 0, log[-4000:]
    assert "no batch platform detected" in log  # the ConfigMap's FT_PLATFORM=none
    assert (out / "final" / "model" / "model.safetensors").exists()
    assert committed_steps(out)[-1] == int(STEPS["FT_MAX_STEPS"])  # checkpoints a retried pod would resume from
    assert (out / "mlflow" / "mlflow.db").exists()  # no MLFLOW_TRACKING_URI in the ConfigMap: the store is on the volume
    assert "Invalid value for environment variable" not in log  # libgomp, when the training process got OMP_NUM_THREADS=None


def copy_as_another_uid(source: Path, target: Path) -> subprocess.CompletedProcess:
    """Copy a folder as a serving pod or a copy job under another uid would read it (as nobody when root)."""
    target.parent.mkdir()
    as_nobody = {}
    if os.geteuid() == 0:
        shutil.chown(target.parent, OTHER_UID, OTHER_UID)
        as_nobody = {"user": OTHER_UID, "group": OTHER_UID, "extra_groups": []}
    return subprocess.run(["cp", "-r", str(source), str(target)], capture_output=True, text=True, timeout=60, **as_nobody)


def test_the_final_model_loads_from_the_host_as_another_uid(reference, shared):
    _code, out, _log = reference
    copy = copy_as_another_uid(out / "final" / "model", shared / "copies" / "model")
    assert copy.returncode == 0, copy.stderr  # model.safetensors was written 0600: "Permission denied"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(shared / "copies" / "model")
    tokenizer = AutoTokenizer.from_pretrained(shared / "copies" / "model")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Reverse: apple river stone"}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    assert model.generate(**inputs, max_new_tokens=4, do_sample=False).shape[-1] > inputs["input_ids"].shape[-1]


# -- Stop, resume, give up -------------------------------------------------------------------------


def max_weight_difference(a: Path, b: Path) -> float:
    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys()
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


@pytest.mark.faults("SIGTERM to the container mid-run")
def test_stop_exits_75_with_a_committed_checkpoint_and_train_resumes_to_the_uninterrupted_weights(reference, shared, say):
    # As the README's `docker run` line: --user of the folder's owner, a uid the image does not know.
    out = containers.volume(shared / "stopped", (HOST_UID, HOST_UID))
    flags = ("--user", f"{HOST_UID}:{HOST_UID}")
    job = Container(out, DEMO | STEPS, shared / "stopped.log", flags=flags)
    wait_for(lambda: committed_steps(out) or job.process.poll() is not None, timeout=300, what="the first checkpoint")
    stopped_at, periodic = time.monotonic(), committed_steps(out)
    job.stop()
    code = job.wait()
    stop_seconds = time.monotonic() - stopped_at
    say(f"stop to exit: {stop_seconds:.2f} s (podman/docker stop -> tini -> entrypoint.py -> training process)")
    assert code == 75, job.output()[-4000:]
    stop_step = committed_steps(out)[-1]
    assert periodic[-1] < stop_step < int(STEPS["FT_MAX_STEPS"]), (periodic, stop_step)  # saved by the stop, mid-run
    assert f"checkpoint at step {stop_step} committed" in job.output()

    # SageMaker starts training images as `docker run IMAGE train`: the same job, resumed from the volume.
    resumed = Container(out, DEMO | STEPS, shared / "resumed.log", args=("train",), flags=flags)
    assert resumed.wait() == 0, resumed.output()[-4000:]
    assert f"resuming from /output/checkpoints/checkpoint-{stop_step}" in resumed.output()
    difference = max_weight_difference(reference[1] / "final" / "model" / "model.safetensors", out / "final" / "model" / "model.safetensors")
    say(f"stopped at step {stop_step} and resumed: final weights differ from the uninterrupted job's by at most {difference:.3g}")
    assert difference <= 1e-5


def test_the_image_reads_s3_data_and_mirrors_to_s3_through_aws_endpoint_url(shared, say):
    """The packages an s3:// URL needs are in the image: moto's S3 server on the host's loopback, the container on the host's network."""
    import json

    from s3server import SECRET_KEY, S3Server

    from trainer.data import demo

    (shared / "s3").mkdir()
    server = S3Server(shared / "s3").start()
    try:
        fs = server.filesystem()
        fs.mkdir("fulltune-data")
        fs.mkdir("fulltune-mirror")
        fs.pipe("fulltune-data/chats/train.jsonl", "".join(json.dumps(row) + "\n" for row in demo.conversations(200, seed=5)).encode())
        out = image_volume(shared / "s3-volume")
        env = DEMO | server.env() | {"FT_MAX_STEPS": "6", "FT_EVAL_STEPS": "3", "FT_SAVE_STEPS": "6", "FT_DATASET": "s3://fulltune-data/chats/train.jsonl",
                                    "FT_MIRROR_URL": "s3://fulltune-mirror/container"}
        started = time.monotonic()
        code = containers.run(out, env, shared / "s3.log", network="host")
        log = (shared / "s3.log").read_text()
        say(f"demo job, 6 steps, s3:// data and an s3:// mirror: {time.monotonic() - started:.1f} s in the container, exit {code}")
        assert code == 0, log[-4000:]
        assert "train: FT_DATASET='s3://fulltune-data/chats/train.jsonl', format messages: 200 rows read" in log
        assert "mirrored checkpoint at step 6: s3://fulltune-mirror/container/checkpoints/checkpoint-6" in log
        final = json.loads(fs.cat("fulltune-mirror/container/final/commit.json"))
        assert fs.cat("fulltune-mirror/container/final/model/model.safetensors") == (out / "final" / "model" / "model.safetensors").read_bytes()
        assert "model/model.safetensors" in final["files"] and SECRET_KEY not in log
    finally:
        server.stop()


def entrypoint_handles_sigterm(job: Container) -> bool:
    """Whether entrypoint.py (tini's child) has installed its SIGTERM handler, read from /proc in the container."""
    probe = (
        "import pathlib\n"
        "for p in pathlib.Path('/proc').glob('[0-9]*'):\n"
        "    try: argv, status = (p / 'cmdline').read_bytes().split(b'\\0'), (p / 'status').read_text()\n"
        "    except OSError: continue\n"
        "    if argv[:2] == [b'python', b'/app/entrypoint.py']:\n"
        "        caught = int(next(l.split()[1] for l in status.splitlines() if l.startswith('SigCgt:')), 16)\n"
        "        print('handled' if caught & (1 << 14) else 'default')\n"  # bit 14: signal 15, SIGTERM
    )
    return job.exec("python", "-c", probe).stdout.strip() == "handled"


@pytest.mark.faults("SIGTERM to the container while the job starts")
def test_a_stop_while_the_job_starts_exits_76_and_leaves_the_volume_without_checkpoints(shared):
    out = image_volume(shared / "starting")
    job = Container(out, DEMO, shared / "starting.log")
    wait_for(lambda: entrypoint_handles_sigterm(job) or job.process.poll() is not None, timeout=120, what="entrypoint.py's signal handler")
    job.stop()  # the training process is still importing torch, or not started yet
    assert job.wait() == 76, job.output()[-4000:]
    assert "while starting; a retry resumes from the last committed checkpoint" in job.output()
    assert committed_steps(out) == []


@pytest.mark.faults("a second signal to the container before the checkpoint is committed")
def test_a_second_signal_before_the_checkpoint_is_committed_exits_76_at_once(shared):
    out = image_volume(shared / "second-signal")
    slow_steps = {"FT_GRADIENT_ACCUMULATION_STEPS": "256", "FT_MAX_STEPS": "10"}  # an optimizer step of several seconds
    job = Container(out, DEMO | slow_steps, shared / "second-signal.log")
    wait_for(lambda: "starting from step 0" in job.output() or job.process.poll() is not None, timeout=300, what="training to start")
    job.signal("SIGTERM")
    wait_for(lambda: "SIGTERM received: saving a checkpoint" in job.output() or job.process.poll() is not None, timeout=30, what="the first SIGTERM")
    started = time.monotonic()
    job.signal("SIGTERM")
    assert job.wait() == 76, job.output()[-4000:]
    assert time.monotonic() - started < 10
    assert "second SIGTERM before the checkpoint was committed" in job.output()
    assert committed_steps(out) == []


# -- The volume ------------------------------------------------------------------------------------


@pytest.mark.faults("a volume the image's user cannot write")
def test_an_output_folder_the_images_user_cannot_write_exits_2_in_seconds_naming_the_fix(shared):
    out = shared / "root-owned"  # as a folder that `docker run -v` creates, or one made by the host user
    out.mkdir()
    out.chmod(0o755)
    started = time.monotonic()
    code = containers.run(out, DEMO, shared / "root-owned.log")
    seconds = time.monotonic() - started
    log = (shared / "root-owned.log").read_text()
    assert code == 2, log[-3000:]
    uid = containers.image_user()[0]
    for expected in ("FT_OUTPUT_DIR=/output is not writable", f"uid {uid}", "fsGroup", "docker run --user", f"chown {uid}"):
        assert expected in log, expected
    assert seconds < 20 and "memory plan" not in log and "data:" not in log  # before any model or data is loaded
    assert list(out.iterdir()) == []


# -- The image itself ------------------------------------------------------------------------------

SEARCH = "/opt/venv/bin:/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_the_image_has_no_build_tool_beyond_the_c_compiler_triton_needs_and_pip_check_is_clean():
    tools = "c++ g++ clang make cmake"
    script = f"PATH={SEARCH}; for tool in {tools}; do command -v $tool; done; pip check"
    result = containers.engine("run", "--rm", "--network", "none", "--read-only", "--entrypoint", "sh", containers.IMAGE, "-c", script)
    assert result.stdout.splitlines() == ["No broken requirements found."], result.stdout + result.stderr


# What Triton does at a kernel's first launch (triton/runtime/build.py): find gcc (or $CC), compile a C file that includes
# Python.h into an extension module in its cache folder on /tmp, and import it.
PYTHON_EXTENSION = r"""
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&module); }
"""
COMPILE_AND_IMPORT = """set -e
cd "$TRITON_CACHE_DIR" 2>/dev/null || { mkdir -p "$TRITON_CACHE_DIR" && cd "$TRITON_CACHE_DIR"; }
printf '%s' "$SOURCE" > probe.c
include=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc probe.c -O3 -shared -fPIC -I"$include" -o "probe$suffix"
cc --version | head -1 >&2
python -c 'import probe; print(probe.answer())'
"""


def test_the_image_compiles_and_imports_a_python_extension_as_triton_does_at_its_first_kernel():
    """Without gcc and Python.h the first CUDA training step fails ("Failed to find C compiler"): TRL's fused LM head runs
    Triton kernels on every forward.  As the container runs: read-only root, /tmp a tmpfs, the image's own user."""
    result = containers.engine("run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp:exec", "-e", f"SOURCE={PYTHON_EXTENSION}",
                               "--entrypoint", "sh", containers.IMAGE, "-c", COMPILE_AND_IMPORT)
    assert (result.returncode, result.stdout.strip()) == (0, "42"), result.stdout + result.stderr


def from_human(size: str) -> float:
    """Bytes from the engines' sizes: "272 kB" (podman), "272kB" (docker), decimal units."""
    number, unit = re.fullmatch(r"([\d.]+)\s*([kMGT]?B)", size.strip()).groups()
    return float(number) * 1000 ** "BkMGT".index(unit[0] if len(unit) == 2 else "B")


def test_image_and_layer_sizes_are_printed_and_the_code_layers_are_small(say):
    size = int(containers.inspect(containers.IMAGE, "{{.Size}}"))
    say(f"image {containers.IMAGE}: {size / 1e9:.2f} GB; its layers, newest first:")
    history = containers.engine("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", containers.IMAGE).stdout.splitlines()
    rows = [(from_human(layer_size), " ".join(created_by.split())) for layer_size, _, created_by in (line.partition("\t") for line in history)]
    for layer_size, created_by in rows:
        say(f"  {layer_size / 1e6:10.1f} MB  {created_by[:110]}")
    code = rows[: next(i for i, (_, created_by) in enumerate(rows) if "WORKDIR /app" in created_by)]  # what the Dockerfile adds after WORKDIR
    assert 0 < sum(layer_size for layer_size, _ in code) < 5e6, code  # the code, rebuilt on every change, is small
    assert sum(layer_size for layer_size, _ in rows) == pytest.approx(size, rel=0.05)


def layers(image: str) -> list[str]:
    return containers.inspect(image, "{{range .RootFS.Layers}}{{println .}}{{end}}").split()


def test_a_change_under_trainer_rebuilds_only_the_code_layers_in_seconds(tmp_path, say):
    context = tmp_path / "context"  # a copy of the build context: the real tree stays as it is
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore", "entrypoint.py", "requirements.txt", "requirements.lock"):
        shutil.copy2(REPO / name, context / name)
    shutil.copytree(REPO / "trainer", context / "trainer", ignore=shutil.ignore_patterns("__pycache__"))
    with open(context / "trainer" / "__init__.py", "a") as f:
        f.write(f"# changed by the rebuild test {uuid.uuid4().hex}\n")
    tag = f"fulltune-rebuild-test:{uuid.uuid4().hex[:10]}"
    started = time.monotonic()
    build = containers.engine("build", *containers.BUILD_ARGS, "-t", tag, str(context), timeout=900)
    seconds = time.monotonic() - started
    try:
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        before, after = layers(containers.IMAGE), layers(tag)
    finally:
        containers.engine("rmi", "--force", tag)
    say(f"rebuild after a change under trainer/: {seconds:.1f} s")
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert changed == [len(before) - 2, len(before) - 1], f"layers rebuilt: {changed} of {len(before)}"  # COPY trainer/, compileall
    assert seconds < 90


GS_AND_AZ = """
from trainer.core import objectstore
for url, options in (("gs://bucket/chats/train.jsonl", {"token": "anon"}), ("az://container/chats/train.jsonl", {"account_name": "example", "anon": True})):
    fs, path = objectstore.filesystem(url, "FT_DATASET", **options)
    print(type(fs).__module__.split(".")[0], path)
"""


def test_the_image_opens_gs_and_az_urls_with_the_pinned_filesystem_packages():
    """No emulator of GCS or Azure Blob is on the package registries here: the image is held to building the filesystem
    an s3:// URL's siblings need (gcsfs, adlfs, as pinned), without the network, as the job opens FT_DATASET and FT_MIRROR_URL."""
    result = containers.engine("run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python", containers.IMAGE,
                               "-c", GS_AND_AZ)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split("\n")[:2] == ["gcsfs bucket/chats/train.jsonl", "adlfs container/chats/train.jsonl"], result.stdout
