"""A hub that does not answer ends the job in seconds with exit 1, naming the id and how to run offline."""

from __future__ import annotations

import socket
import time

import pytest

from conftest import NO_EVALUATION, job_env, run_job, termination_message

CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens there


def hub_env(out, endpoint: str, **settings: str) -> dict[str, str]:
    env = job_env(out, HF_ENDPOINT=endpoint, HF_HOME=str(out.parent / "hf-home"), **settings)  # an empty cache
    del env["HF_HUB_OFFLINE"]
    return env


@pytest.mark.faults
@pytest.mark.parametrize("variable", ["FT_MODEL", "FT_DATASET"])
def test_an_unreachable_hub_exits_1_within_seconds_naming_the_id_and_how_to_run_offline(variable, demo_assets, tmp_path):
    ids = {"FT_MODEL": "Qwen/Qwen3-0.6B", "FT_DATASET": "trl-lib/Capybara"}
    local = {"FT_MODEL": str(demo_assets / "model"), "FT_DATASET": str(demo_assets / "data" / "train.jsonl")}
    out = tmp_path / "volume"
    env = hub_env(out, CLOSED_PORT, **(local | {variable: ids[variable]}))
    started = time.monotonic()
    result = run_job(env, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"exit 1: {variable}={ids[variable]!r}: the Hugging Face hub at {CLOSED_PORT} is unreachable (ConnectError" in result.stderr
    assert "set HF_HUB_OFFLINE=1" in result.stderr and f"{variable}=<" in result.stderr and "Traceback" not in result.stderr
    assert "the Hugging Face hub" in termination_message(env)
    assert not out.exists() or not any(out.iterdir()), "nothing is written before the hub answers (entrypoint.py only checked the folder is writable)"
    print(f"{variable}: exit 1 after {elapsed:.1f} s")
    assert elapsed < 30, elapsed  # huggingface_hub's own retries alone took 23 s per id, 52 s for a dataset


@pytest.mark.faults("a hub that accepts connections but never answers")
def test_a_hub_that_accepts_but_never_answers_is_given_up_after_the_hub_timeout(demo_assets, tmp_path):
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads the request
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = hub_env(tmp_path / "volume", endpoint, FT_MODEL="Qwen/Qwen3-0.6B", FT_DATASET=str(demo_assets / "data" / "train.jsonl"), HF_HUB_ETAG_TIMEOUT="1")
        started = time.monotonic()
        result = run_job(env, timeout=120)
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the Hugging Face hub at {endpoint} is unreachable (ReadTimeout" in result.stderr and "3 tries in" in result.stderr
    print(f"silent hub: exit 1 after {elapsed:.1f} s")
    assert elapsed < 30, elapsed


REVISION_SCRIPT = """
import sys
from trainer.core import config, settings
from trainer.model import loading

for revision in sys.argv[1:]:
    loaded = settings.load({"FT_PLATFORM": "none", "FT_MODEL": "org/tiny-reverser", "FT_MODEL_REVISION": revision})
    tokenizer = loading.load_tokenizer(loaded)
    net = loading.load_model(loaded, tokenizer, config.build(loaded, cuda=False, bf16_supported=False).precision)
    print("LAYERS", loading.read_config(loaded).num_hidden_layers, len(net.model.layers), flush=True)
"""


def test_model_revision_loads_that_revision_of_a_hub_model_from_the_cache(demo_assets, tmp_path):
    """A hub cache (HF_HOME) holding two revisions of one model, as `hf download --revision` leaves it: main has 3 layers,
    the tag v1 (and its commit) the demo's 2.  FT_MODEL_REVISION picks the config, tokenizer and weights the job loads."""
    import json
    import shutil
    import subprocess
    import sys

    from conftest import ROOT

    repo = tmp_path / "hf-home" / "hub" / "models--org--tiny-reverser"
    commits = {"main": "a" * 40, "v1": "b" * 40}
    for ref, commit in commits.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        shutil.copytree(demo_assets / "model", repo / "snapshots" / commit)
    main_config = repo / "snapshots" / commits["main"] / "config.json"
    three = json.loads(main_config.read_text())
    main_config.write_text(json.dumps(three | {"num_hidden_layers": 3, "layer_types": three["layer_types"][:1] * 3}))

    env = job_env(tmp_path / "volume", HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", REVISION_SCRIPT, "v1", commits["v1"], ""], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    layers = [line for line in done.stdout.splitlines() if line.startswith("LAYERS ")]
    assert layers == ["LAYERS 2 2", "LAYERS 2 2", "LAYERS 3 3"]  # v1 by its tag, v1 by its commit, then the default: the hub's main


@pytest.mark.slow
@pytest.mark.parametrize("cache", [pytest.param("shared", marks=pytest.mark.faults("two nodes downloading one hub model into one cache")),
                                   pytest.param("per-node", marks=pytest.mark.faults("two nodes downloading one hub model, a cache each"))])
def test_two_nodes_download_a_hub_model_once_per_cache_rank_0_first(demo_assets, tmp_path, cache):
    """FT_MODEL a hub id on two nodes, each asking its own stand-in hub (tests/hub_standin.py; node 0's answers slowly, as a
    distant hub would, so node 1 would be first to every file): with HF_HOME shared on the volume (the multi-node
    overlays), node 0 downloads each file once and node 1 reads them from the cache, asking its hub for nothing; with a
    cache of its own, node 1 downloads each file once there, after node 0."""
    from hub_standin import StandInHub, hub_env

    from conftest import free_port, start_job

    port = str(free_port())
    model = demo_assets / "model"
    with StandInHub("org/tiny-reverser", model, delay=0.3) as hub0, StandInHub("org/tiny-reverser", model) as hub1:
        nodes = []
        for rank, hub in enumerate((hub0, hub1)):
            env = job_env(tmp_path / "volume", FT_MODEL="org/tiny-reverser", FT_DATASET=str(demo_assets / "data" / "train.jsonl"), FT_MAX_STEPS="2",
                          FT_SAVE_STEPS="2", FT_EVAL_STEPS="2", FT_BATCH_SIZE="4", FT_GRADIENT_ACCUMULATION_STEPS="1", **NO_EVALUATION)
            env |= hub_env(hub, tmp_path / ("hf-home" if cache == "shared" else f"hf-home-{rank}"))
            env |= dict(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port,
                        FT_TERMINATION_MESSAGE_PATH=str(tmp_path / f"node{rank}.termination-log"), OMP_NUM_THREADS="1")
            nodes.append(start_job(env, tmp_path / f"node{rank}.log"))
        codes = [node.wait(timeout=600) for node in nodes]
        assert codes == [0, 0], [(tmp_path / f"node{rank}.log").read_text()[-3000:] for rank in (0, 1)]
    every_file_once = {name: 1 for name in hub0.files}
    print(f"{cache} cache: node 0 downloaded {dict(hub0.downloads)}, node 1 {dict(hub1.downloads)}")
    assert hub0.downloads == every_file_once
    assert hub1.downloads == ({} if cache == "shared" else every_file_once)
