"""Shared helpers: run entrypoint.py as a real subprocess with a clean environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One OpenMP thread per process unless the caller chose: the tests run three at a time (pytest-xdist), and the tiny
# demo model's operations are too small to gain from more.  With torch's default (a thread per core), two jobs'
# threads spin-wait against each other: two concurrent 8-step demo jobs took 61 s each, against 20 s with one thread
# (same eval loss).  Set before anything imports torch, so this process and every job it starts keep it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Where a test runs a job on more threads (test_launch's torch defaults), its idle threads sleep instead of spinning: beside the other
# worker's job, a 40-step, two-thread demo job took 61 CPU-s passive against 101 CPU-s spinning (68 s against 88 s wall).
# The wait policy changes when threads wait, not what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile's Inductor compiles in-process instead of starting a pool of worker processes (each importing torch):
# the one compile test took 45 s instead of 58 s.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
SECRET = "hf_do_not_leak_0123456789"
DEMO_NAME = "demo.default.tiny_qwen3_assistant"  # what the demo preset registers
# The demo preset cut to 40 steps of 8 sequences (4 x 2), for tests of the job's mechanics rather than its learning:
# the preset's own 240 steps of 64 sequences are the README's demo (tests/test_learning.py).
QUICK_DEMO = dict(FT_PRESET="demo", FT_MAX_STEPS="40", FT_BATCH_SIZE="4", FT_GRADIENT_ACCUMULATION_STEPS="2")
# What the job does after training (the FT_EVAL_ROWS answers and FT_EVAL_TASKS benchmarks of base and fine-tuned model)
# and its sample answers (FT_EVAL_SAMPLES), off: for the tests of how it trains, stops, resumes, saves and shares, which
# read neither.  They are most of a short job's work: a 2-step job on the demo model took 21 CPU-s with the default 64
# rows, 10 without; the 40-step QUICK_DEMO 14 CPU-s with the preset's benchmark, 24 rows and 8 samples, 11.5 without.
NO_EVALUATION = dict(FT_EVAL_ROWS="0", FT_EVAL_TASKS="", FT_EVAL_SAMPLES="0")


def job_env(output_dir: Path | str, **settings: str) -> dict[str, str]:
    """The process environment minus any FT_*/MLFLOW_* of the caller, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "MLFLOW_", "FULLTUNE_", "FAULT_"))}
    env.update(
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        FT_OUTPUT_DIR=str(output_dir),
        FT_TERMINATION_MESSAGE_PATH=str(Path(output_dir).parent / f"{Path(output_dir).name}.termination-log"),
    )
    env.update({k: str(v) for k, v in settings.items()})
    return env


def with_faults(env: dict[str, str], **faults: str) -> dict[str, str]:
    """`env` with the test-only fault injection of tests/faults/sitecustomize.py switched on (FAULT_* variables)."""
    folder = str(ROOT / "tests" / "faults")
    path = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    return env | {"PYTHONPATH": path} | {f"FAULT_{name.upper()}": str(value) for name, value in faults.items()}


def run_job(env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def start_job(env: dict[str, str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, str(ROOT / "entrypoint.py")], env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout: float = 180, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def termination_message(env: dict[str, str]) -> str:
    path = Path(env["FT_TERMINATION_MESSAGE_PATH"])
    return path.read_text() if path.exists() else ""


def weights(path: Path) -> dict:
    """The weights of a safetensors file, or of an FSDP checkpoint folder's DCP shards (read whole, in this process)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not Path(path).is_dir():
        return load_file(path)
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(Path(path) / "pytorch_model_fsdp_0", Path(scratch) / "weights.pt")
        return torch.load(Path(scratch) / "weights.pt", weights_only=True)["model"]


def max_weight_difference(a: Path, b: Path) -> float:
    """Largest absolute difference between two checkpoints' weights (same names required): safetensors files, or FSDP
    checkpoint folders."""
    left, right = weights(a), weights(b)
    assert left.keys() == right.keys()
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


# What a DCP folder's `.metadata` pickle may name (torch 2.13's Metadata: its dataclasses, torch's dtypes and Size, the
# layout helper, the checkpoint's path): anything else, a callable that runs on load above all, fails the check.
DCP_METADATA_GLOBALS = ("torch.distributed.checkpoint.", "torch.Size", "torch.serialization._get_layout", "pathlib.")


def assert_no_pickle_beyond_weights_only(folder: Path) -> list[Path]:
    """Every file under `folder` is text (JSON, the tokenizer's), safetensors, a DCP shard folder read back by DCP
    (its byte items with weights_only=True) whose `.metadata` names only DCP's own types, or loads with
    weights_only=True (numpy's array type allowed, as transformers allows it for the RNG states:
    trainer_pt_utils.safe_globals).  The files checked."""
    import io
    import pickle

    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers.trainer_pt_utils import safe_globals

    class MetadataOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            qualified = f"{module}.{name}"
            is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            if not is_dtype and not qualified.startswith(DCP_METADATA_GLOBALS):
                raise pickle.UnpicklingError(f"a DCP .metadata names {qualified}")
            return super().find_class(module, name)

    files = [p for p in Path(folder).rglob("*") if p.is_file()]
    for path in files:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                assert list(f.keys())
        elif path.suffix in (".json", ".jinja", ".txt", ".md"):
            path.read_text(encoding="utf-8")
        elif path.name == ".metadata":
            MetadataOnly(io.BytesIO(path.read_bytes())).load()
            with tempfile.TemporaryDirectory() as scratch:
                dcp_to_torch_save(path.parent, Path(scratch) / "whole.pt")  # every .distcp file of the folder, as a resume reads it
                torch.load(Path(scratch) / "whole.pt", weights_only=True)
        elif path.suffix == ".distcp":
            assert (path.parent / ".metadata").is_file(), path  # read back with its folder's .metadata
        else:
            with safe_globals():
                torch.load(path, weights_only=True)  # raises UnpicklingError for anything but tensors and plain containers
    return files


def committed_steps(output_dir: Path) -> list[int]:
    folder = Path(output_dir) / "checkpoints"
    steps = []
    for path in folder.glob("checkpoint-*"):
        manifest = path / "commit.json"
        if manifest.exists():
            steps.append(json.loads(manifest.read_text())["step"])
    return sorted(steps)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory) -> Path:
    """The demo model, tokenizer and data, built once for the tests that point FT_MODEL at them."""
    from trainer.data import demo

    return Path(demo.ensure_demo(str(tmp_path_factory.mktemp("demo-assets"))))


@pytest.fixture(scope="session")
def demo_job_run(tmp_path_factory, worker_id) -> tuple[Path, subprocess.CompletedProcess]:
    """The demo job as the README runs it (240 steps, registered in the embedded store), run once for the tests that look at its results.

    Once per test run, not once per pytest-xdist worker: three files read it (test_job, test_learning, test_serving),
    and each worker is a session of its own, so the first worker to need it runs it under a file lock in the run's
    shared temporary folder and the others read its volume and output (the tests only read them)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if worker_id != "master" else base) / "demo-job"  # under xdist: the folder above each worker's
    shared.mkdir(exist_ok=True)
    out, record = shared / "volume", shared / "result.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if not record.exists():  # recorded whatever the outcome: a second run into the same volume would resume this one
            # MLflow samples system metrics every 10 s by default, longer than this demo job trains.  ~120 CPU-s, but
            # beside another test file and the image build on two cores it can get half a core: 15 minutes before calling it hung.
            env = job_env(out, FT_PRESET="demo", HF_TOKEN=SECRET, MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="0.5")
            try:
                result = run_job(env, timeout=900)
            except subprocess.TimeoutExpired as hung:
                said = [part.decode() if isinstance(part, bytes) else part or "" for part in (hung.stdout, hung.stderr)]
                result = subprocess.CompletedProcess(hung.cmd, -9, said[0], said[1] + f"\n(killed: still running after {hung.timeout:.0f} s)")
            record.write_text(json.dumps({"args": result.args, "returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}))
    result = subprocess.CompletedProcess(**json.loads(record.read_text()))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy_reply(model_dir: Path, text: str, max_new_tokens: int, tokenizer_dir: Path | None = None, dtype=None) -> list[int]:
    """The reply's token ids, as transformers generates them greedily from the weights in `model_dir` (in `dtype`,
    default as stored) with the tokenizer and chat template in `tokenizer_dir` (default: the same folder)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **({"dtype": dtype} if dtype else {}))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, prompt["input_ids"].shape[1] :].tolist()


def assert_answers_as_transformers_does(response: dict, model_dir: Path, text: str, max_tokens: int, name: str = DEMO_NAME) -> None:
    """`response` is an OpenAI chat.completion whose answer is, token for token, the greedy reply of the weights in
    `model_dir`, and which names the model `name`."""
    from transformers import AutoTokenizer, GenerationConfig

    reply = greedy_reply(model_dir, text, max_tokens)
    expected = AutoTokenizer.from_pretrained(model_dir).decode(reply, skip_special_tokens=True)
    print(f"served {response['choices'][0]['message']['content']!r}, transformers {expected!r} ({len(reply)} tokens)")
    assert response["object"] == "chat.completion" and response["model"] == name
    assert response["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert response["usage"]["completion_tokens"] == len(reply)
    cut_short = len(reply) == max_tokens and reply[-1] != GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert response["choices"][0]["finish_reason"] == ("length" if cut_short else "stop")


class MlflowServer:
    """A real `mlflow server` on a loopback port, with its store in `folder`: killed and started again on the same
    port and store, as a tracking server that goes away mid-run and comes back."""

    def __init__(self, folder: Path, port: int | None = None):
        self.folder, self.port = Path(folder), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{self.folder}/server.db", "--artifacts-destination", str(self.folder / "server-artifacts")]
        log = open(self.folder / "server.log", "a")  # noqa: SIM115 - closed with the process
        # Without MLflow 3's job runner (GenAI jobs: four more processes, each importing MLflow); tracking and the
        # registry are served the same.
        env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        # its own process group: kill takes the workers too
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.answers, timeout=120, what="mlflow server")
        return self

    def answers(self) -> bool:
        import urllib.request

        assert self.process.poll() is None, (self.folder / "server.log").read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        import signal

        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


# -- The inventory of bad inputs and faults the suite exercises ---------------------------------------
# A test that feeds the job one bad input or one fault carries `@pytest.mark.faults` (a parametrized one: one
# per parameter set, named by its id) or `@pytest.mark.faults("what", "else", ...)` when one test exercises
# several.  `pytest --collect-only -q --faults` lists them; docs/preemption-and-failures.md states how many (tests/test_faults_inventory.py).


def pytest_addoption(parser):
    parser.addoption("--faults", action="store_true", help="print the bad inputs and faults the collected tests exercise, one per line")


def faults_of(item) -> list[str]:
    """The bad inputs and faults one collected test exercises (none when it is not marked)."""
    marker = item.get_closest_marker("faults")
    if marker is None:
        return []
    if marker.args:
        return list(marker.args)
    callspec = getattr(item, "callspec", None)
    return [f"{item.originalname}[{callspec.id}]" if callspec else item.name]


# The files that take longest (wall time each, measured with three workers on 2 cores: 620 s down to 15 s), run first,
# so that the shorter ones fill in at the end instead of one long file running alone: pytest-xdist hands out whole files
# (--dist loadfile) in collection order, once its own reordering (most tests first, which put the single 150-second
# test last) is switched off below.  test_learning only reads the demo job test_job runs (demo_job_run): it comes late, so
# that its worker does not wait for that run.  Only the order changes: a stale list costs minutes, never a result.
LONGEST_FIRST = (
    "test_preemption", "test_scale_out", "test_tracking_outage", "test_mirror", "test_bench", "test_storage_faults", "test_job", "test_evaluation",
    "test_stepdown", "test_lease", "test_documented_values", "test_telemetry", "test_cadence_job", "test_memory", "test_hub",
    "test_k8s", "test_log", "test_push_to_hub", "test_divergence", "test_plan_vs_simulation", "test_samples", "test_lease_lock",
    "test_checkpoint_saving", "test_serving", "test_jit_checkpoint", "test_structure", "test_report", "test_cloud_specs", "test_step_cost",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.7 (--no-loadscope-reorder)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's own order is kept


def pytest_collection_finish(session):
    if session.config.getoption("--faults"):
        for item in session.items:
            for fault in faults_of(item):
                print(f"fault\t{item.nodeid}\t{fault}")
