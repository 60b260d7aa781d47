"""Memory and disk preflight: the estimate against measured peaks, and exit 2 naming what to change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, job_env, run_job, termination_message
from trainer.core.config import PRECISIONS
from trainer.model import disk_space, memory
from trainer.model.memory import Plan

QWEN3_4B = ROOT / "bench" / "qwen3-4b-config.json"


def _settings(**changes):
    from trainer.core import settings as settings_table

    env = {"FT_MODEL": str(QWEN3_4B.parent), "FT_OUTPUT_DIR": "/tmp/unused", "FT_MAX_LENGTH": "2048"} | changes
    return settings_table.load(env)


def _qwen3(path):
    from transformers import Qwen3Config

    return Qwen3Config(**{k: v for k, v in json.loads(path.read_text()).items() if k not in ("architectures", "torch_dtype")})


def _qwen3_4b():
    return _qwen3(QWEN3_4B)


def test_qwen3_4b_needs_16_bytes_per_parameter_before_activations():
    from trainer.model.loading import parameter_count

    config = _qwen3_4b()
    n = parameter_count(config)
    assert 4.0e9 < n < 4.05e9
    parts = memory.estimate(config, n, precision=PRECISIONS["bf16-mixed"], sequences_per_pass=1, passes_per_step=8, max_length=2048, checkpoint_every=1)
    assert parts["weights"] + parts["gradients"] + parts["optimizer"] == pytest.approx(16 * n)
    assert parts["loss"] < 2e9  # chunked: never (tokens x 151936) logits


def test_bf16_sr_needs_12_bytes_per_parameter_and_10_per_checkpoint():
    from trainer.model.loading import parameter_count

    config = _qwen3_4b()
    n = parameter_count(config)
    layout = {"sequences_per_pass": 1, "passes_per_step": 8, "max_length": 2048, "checkpoint_every": 1}
    sr = memory.estimate(config, n, precision=PRECISIONS["bf16-sr"], **layout)
    mixed = memory.estimate(config, n, precision=PRECISIONS["bf16-mixed"], **layout)
    assert sr["weights"] + sr["gradients"] + sr["optimizer"] == pytest.approx(12 * n)  # 48 GB instead of 64
    assert "bf16 copies" not in sr and "bf16 copies" in mixed
    assert sum(mixed.values()) - sum(sr.values()) > 5 * n  # sr's peak is its update: fp32 temporaries of the embedding
    assert PRECISIONS["bf16-sr"].checkpoint_bytes * n == pytest.approx(10 * n)
    assert PRECISIONS["bf16-mixed"].checkpoint_bytes * n == pytest.approx(12 * n)


MEASURE = textwrap.dedent(
    """
    import json, os, sys, threading, time, torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trainer.model import memory
    from trainer.core.config import PRECISIONS
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=16000, hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    # The peak of the resident set while training, sampled, minus what it was just before: the
    # process-lifetime maximum (ru_maxrss) would include transient peaks of the imports.
    highest, running = [0], [True]
    def sample():
        while running[0]:
            highest[0] = max(highest[0], rss())
            time.sleep(0.0005)
    before = rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    net = Qwen3ForCausalLM(config)
    every = int(sys.argv[1])  # FT_ACTIVATION_CHECKPOINTING's layer policy: 0 off, 1 full, n every n-th layer
    if every:
        net.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ids = torch.randint(0, 16000, (4, 512))
    for _ in range(2):
        net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step(); optimizer.zero_grad()
    running[0] = False
    sampler.join()
    peak = highest[0] - before
    n = sum(p.numel() for p in net.parameters())
    each = memory.phases(config, n, precision=PRECISIONS["fp32"], sequences_per_pass=4, passes_per_step=1, max_length=512, checkpoint_every=every)
    # transformers' own loss (not TRL's chunked one) materialises the full logits, their softmax and gradient
    for name in ("forward", "backward start"):
        each[name]["loss"] = 4 * 512 * 16000 * 4 * 3
    print(json.dumps({"measured": peak, "estimated": max(sum(parts.values()) for parts in each.values())}))
    """
)


@pytest.mark.slow  # three training subprocesses
def test_estimate_follows_the_measured_peak_on_cpu_for_each_recomputation_policy():
    """No recomputation, every 2nd layer (FT_ACTIVATION_CHECKPOINTING=selective) and every layer (full).

    glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), so the tensors that
    follow come from the heap and what they free stays resident: under its defaults the resident set of a step with
    every layer recomputed peaks ~30 % above its live tensors (bench/recompute_retention.py --rss).  A fixed
    threshold turns that off, and the resident set follows the tensors."""
    results = {}
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "131072"}
    for every in (0, 2, 1):
        out = subprocess.run([sys.executable, "-c", MEASURE, str(every)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=True)
        results[every] = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(abs(results[every]["estimated"] / results[every]["measured"] - 1) <= memory.TOLERANCE for every in (0, 2, 1)), results
    measured = [results[every]["measured"] for every in (0, 2, 1)]
    assert measured[0] > measured[1] > measured[2], results  # selective saves memory, full saves more


def test_plan_uses_one_pass_when_it_fits_and_splits_the_step_when_it_does_not():
    settings, config, n = _settings(), _qwen3_4b(), 4_022_468_096
    mixed = PRECISIONS["bf16-mixed"]
    roomy = memory.plan(config, n, settings, mixed, 250e9, "auto")
    assert (roomy.sequences_per_pass, roomy.passes_per_step, roomy.checkpoint_every) == (8, 1, 0)
    h100 = memory.plan(config, n, settings, mixed, 85.5e9, "auto")  # an 80 GB H100 reports 81,559 MiB
    assert (h100.sequences_per_pass, h100.passes_per_step, h100.checkpoint_every) == (8, 1, 1) and h100.fits  # before the phases: 2 x 4
    layouts = memory.candidates(config, n, settings, mixed, 0.0, "off")
    one_pass, smallest = layouts[0], min(layouts, key=lambda c: c.peak)
    tight = memory.plan(config, n, settings, mixed, (one_pass.peak + smallest.peak) / 2, "off")
    assert tight.passes_per_step > 1 and tight.fits and not tight.checkpointing


def test_candidates_run_from_the_fastest_layout_to_the_smallest_for_a_step_down():
    settings, config, n = _settings(), _qwen3_4b(), 4_022_468_096
    layouts = memory.candidates(config, n, settings, PRECISIONS["bf16-mixed"], 85.5e9, "auto")
    assert [(c.passes_per_step, c.checkpoint_every) for c in layouts[:2]] == [(1, 0), (1, 36)]  # one pass first, least recomputation first (one layer of 36)
    assert layouts[-1].passes_per_step == 8 and layouts[-1].checkpoint_every == 1
    assert memory.plan(config, n, settings, PRECISIONS["bf16-mixed"], 85.5e9, "auto") == next(c for c in layouts if c.fits)
    assert all(c.sequences_per_pass * c.passes_per_step == 8 for c in layouts)


def test_plan_recomputes_only_as_many_layers_as_the_memory_needs():
    """At a layout set as one pass of 8 (FT_BATCH_LAYOUT=as-set): each layer recomputed costs time, so the fastest plan
    that fits recomputes as few as fit (with auto layouts the cost model may rather split the step: test_step_cost.py)."""
    settings, config, n = _settings(FT_BATCH_LAYOUT="as-set", FT_BATCH_SIZE="8", FT_GRADIENT_ACCUMULATION_STEPS="1"), _qwen3_4b(), 4_022_468_096

    def one_pass(every):
        return sum(
            memory.estimate(
                config, n, precision=PRECISIONS["bf16-sr"], sequences_per_pass=8, passes_per_step=1, max_length=2048, checkpoint_every=every
            ).values()
        )

    capacity = (one_pass(2) + one_pass(0)) / 2  # recomputing every 2nd layer fits, none does not
    chosen = memory.plan(config, n, settings, PRECISIONS["bf16-sr"], capacity, "auto")
    assert (chosen.sequences_per_pass, chosen.passes_per_step) == (8, 1) and chosen.fits
    assert 1 < chosen.checkpoint_every < 36 and "selective" in chosen.describe()
    choices = memory.recomputation_choices("auto", 36, limited=True)
    assert one_pass(choices[choices.index(chosen.checkpoint_every) - 1]) > capacity  # recomputing less would not fit
    assert memory.plan(config, n, settings, PRECISIONS["bf16-sr"], capacity, "full").checkpoint_every == 1
    assert memory.plan(config, n, settings, PRECISIONS["bf16-sr"], capacity, "off").checkpoint_every == 0
    assert memory.plan(config, n, settings, PRECISIONS["bf16-sr"], 0.0, "auto").checkpoint_every == 0  # CPU: never


@pytest.mark.faults("a GPU too small for the configuration")
@pytest.mark.slow
def test_preflight_exits_2_naming_the_settings_when_the_gpu_is_too_small(tmp_path):
    env = job_env(tmp_path / "out", FT_PRESET="demo", FT_GPU_MEMORY_GB="0.005", FT_MAX_LENGTH="512")
    result = run_job(env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "does not fit" in result.stderr and "To fit, set" in result.stderr
    assert "activations" in result.stderr  # the breakdown
    assert not (tmp_path / "out" / "checkpoints").exists()  # nothing trained
    assert "exit 2" in termination_message(env)


@pytest.mark.faults("a volume too small for the checkpoints")
def test_disk_check_names_the_settings_when_checkpoints_do_not_fit(tmp_path):
    settings = _settings(FT_OUTPUT_DIR=str(tmp_path), FT_MAX_STEPS="1000", FT_SAVE_STEPS="25", FT_EVAL_STEPS="25")
    problem = disk_space.check_disk(settings, n_params=10**12, precision=PRECISIONS["bf16-mixed"])  # a 1T model: 12 TB per checkpoint
    assert problem and "FT_SAVE_TOTAL_LIMIT" in problem and "FT_SAVE_STEPS" in problem
    assert disk_space.check_disk(settings, n_params=1000, precision=PRECISIONS["bf16-mixed"]) is None


@pytest.mark.faults("a model no single GPU fits")
def test_a_model_too_big_for_one_gpu_is_told_how_many_gpus_fit_it_and_they_do(tmp_path):
    """Qwen3-8B (weights, gradients and AdamW states alone: 131 GB) on 80 GB H100s: the preflight names the GPUs."""
    from trainer.core import settings as settings_table
    from trainer.model import loading as model

    config = _qwen3(ROOT / "bench" / "configs" / "qwen3-8b" / "config.json")
    n = model.parameter_count(config)
    settings = settings_table.load({"FT_OUTPUT_DIR": str(tmp_path), "FT_PLATFORM": "none"})
    mixed, capacity = PRECISIONS["bf16-mixed"], 85.5e9
    assert not memory.plan(config, n, settings, mixed, capacity, "auto", 1).fits
    assert any(fix.startswith("FT_NUM_PROCESSES=4 (FSDP across 4 GPUs") for fix in memory._fixes(config, n, settings, mixed, capacity, 1))
    four = memory.plan(config, n, settings, mixed, capacity, "auto", 4)
    assert (four.strategy, four.processes) == ("fsdp", 4) and four.fits
    layout = {"sequences_per_pass": four.sequences_per_pass, "passes_per_step": four.passes_per_step,
              "max_length": settings.max_length, "checkpoint_every": four.checkpoint_every}
    update = memory.phases(config, n, precision=mixed, shards=4, **layout)["optimizer"]
    assert update["weights"] + update["gradients"] + update["optimizer"] == pytest.approx(16 * n / 4)
    assert not memory.plan(config, n, settings, mixed, capacity, "auto", 2).fits  # 2 shards are not enough: 4 is the smallest


def test_under_fsdp_nothing_is_staged_for_checkpoints_and_the_host_must_hold_the_final_weights_once():
    """Each FSDP rank writes its DCP shard from where it is; the main process gathers the final model's weights."""
    fp32, host = PRECISIONS["fp32"], memory.host_memory_bytes()
    fsdp, ddp = Plan(1, 1, 0, {}, 0.0, strategy="fsdp", processes=8), Plan(1, 1, 0, {}, 0.0, strategy="ddp", processes=8)
    assert memory.checkpoint_staging_bytes(fp32, 10**9, "fsdp", 8) == 0
    assert memory.checkpoint_staging_bytes(fp32, 10**9, "ddp", 8) == 12 * 10**9
    # weights the host cannot hold whole (4/3 of it), although an eighth of the checkpoint would fit
    problem = memory.check_host_memory(fp32, host // 3, fsdp, cuda=True)
    assert problem and "the final model's weights, gathered on it once" in problem and "more memory" in problem
    # half the host for the final weights: fits under FSDP; DDP stages the whole checkpoint (1.5 x the host)
    assert memory.check_host_memory(fp32, host // 8, fsdp, cuda=True) is None
    assert "the checkpoint snapshot" in memory.check_host_memory(fp32, host // 8, ddp, cuda=True)


def test_under_fsdp_a_plan_recomputes_no_layer_or_every_layer_as_accelerates_fsdp_does():
    """accelerate 1.15's FSDP2 checkpointing wraps every decoder layer (no every-n): a "selective" FSDP plan would run
    full recomputation, and stepping down between two of them would change nothing but cost a restart."""
    from trainer.core import settings as settings_table
    from trainer.model import loading, stepdown

    config = _qwen3(ROOT / "bench" / "configs" / "qwen3-8b" / "config.json")
    n, mixed = loading.parameter_count(config), PRECISIONS["bf16-mixed"]
    settings = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused", "FT_PLATFORM": "none"})
    fsdp = memory.candidates(config, n, settings, mixed, 85.5e9, "auto", 4, "fsdp")
    assert {c.checkpoint_every for c in fsdp} == {0, 1} and not any("selective" in c.describe() for c in fsdp)
    chain = [fsdp[0]]
    while (lower := stepdown.next_down(chain[-1], fsdp)) is not None:
        chain.append(lower)
    assert all((a.sequences_per_pass, a.checkpoint_every) != (b.sequences_per_pass, b.checkpoint_every) for a, b in zip(chain, chain[1:], strict=False))
    assert {c.checkpoint_every for c in memory.candidates(config, n, settings, mixed, 85.5e9, "selective", 4, "fsdp")} == {1}
    ddp = memory.candidates(config, n, settings, mixed, 85.5e9, "auto", 4, "ddp")
    assert len({c.checkpoint_every for c in ddp}) > 2  # DDP and one process recompute every n-th layer (transformers' every_n_layers)


def test_several_processes_on_a_gpu_plan_nccls_own_buffers_one_process_and_cpu_do_not():
    """NCCL allocates its communicator's buffers outside torch's caching allocator: ~1 GiB more per GPU in the plan."""
    from trainer.model import estimate

    settings, config, n = _settings(), _qwen3_4b(), 4_022_468_096
    mixed = PRECISIONS["bf16-mixed"]
    alone = memory.candidates(config, n, settings, mixed, 0.0, "full", 1, "none")[0]
    two = memory.candidates(config, n, settings, mixed, 0.0, "full", 2, "ddp")[0]
    assert (alone.sequences_per_pass, alone.checkpoint_every) == (two.sequences_per_pass, two.checkpoint_every)
    assert two.breakdown["workspace"] - alone.breakdown["workspace"] == estimate.NCCL_BUFFERS == 2**30
    assert two.peak - alone.peak == 2**30  # DDP holds a whole model each: nothing else differs
    assert "workspace" not in memory.candidates(config, n, settings, PRECISIONS["fp32"], 0.0, "full", 2, "ddp")[0].breakdown  # gloo on CPU


def test_fsdp_over_nodes_shards_within_a_node_while_its_gpus_hold_the_model_else_over_every_gpu():
    """Two 8-GPU nodes: Qwen3-14B fits 8 H100s, so each node holds it sharded over its own GPUs and the nodes replicate
    it (HSDP: each layer's gathers stay on the node); Qwen3-32B needs all 16 H200s, so it shards over both nodes."""
    from trainer.core import settings as settings_table
    from trainer.model import estimate, loading, recipe

    settings = settings_table.load({"FT_OUTPUT_DIR": "/tmp/unused", "FT_PLATFORM": "none", "FT_NUM_NODES": "2", "FT_NUM_PROCESSES": "8",
                                 "FT_MASTER_ADDR": "node-0"})
    mixed = PRECISIONS["bf16-mixed"]
    config = _qwen3(ROOT / "bench" / "configs" / "qwen3-14b" / "config.json")
    hsdp = memory.plan(config, loading.parameter_count(config), settings, mixed, 85.5e9, "auto", 16)
    assert (hsdp.strategy, hsdp.replicas, hsdp.shards, hsdp.fits) == ("fsdp", 2, 8, True)
    assert "fsdp: 1/8 of the model each, sharded within each of 2 nodes and replicated across them" in hsdp.describe()
    flat = memory.candidates(config, loading.parameter_count(config), settings, mixed, 85.5e9, "auto", 16, "fsdp", 1)
    same = next(c for c in flat if (c.sequences_per_pass, c.checkpoint_every) == (hsdp.sequences_per_pass, hsdp.checkpoint_every))
    assert hsdp.breakdown["weights"] == 2 * same.breakdown["weights"]  # 1/8 of the weights, not 1/16
    assert hsdp.breakdown["workspace"] - same.breakdown["workspace"] > 2 * estimate.NCCL_BUFFERS  # three communicators, not one
    pc = recipe.sft_config(settings, mixed, hsdp, cuda=False).parallelism_config
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.fsdp_dim_names) == (2, 8, ["dp_replicate", "dp_shard_cp"])
    assert recipe.sft_config(settings, mixed, same, cuda=False).parallelism_config is None

    big = _qwen3(ROOT / "bench" / "configs" / "qwen3-32b" / "config.json")
    wide = memory.plan(big, loading.parameter_count(big), settings, mixed, 150.8e9, "auto", 16)
    assert (wide.strategy, wide.replicas, wide.shards, wide.fits) == ("fsdp", 1, 16, True)


@pytest.mark.faults("a host too small for every process's copy of the model while it loads")
def test_the_preflight_exits_2_when_the_hosts_memory_cannot_hold_every_process_loading_the_whole_model(tmp_path):
    """Every process on a node loads the whole fp32 model before DDP moves it to its GPU or FSDP shards it: 8 processes
    of a model a sixteenth of the host's memory need twice the host, though the final gather (a quarter) would fit."""
    import json as json_module

    from transformers import Qwen3Config

    from trainer.core import settings as settings_table
    from trainer.core.config import Config
    from trainer.core.errors import ConfigError
    from trainer.model import loading

    host = memory.host_memory_bytes()
    hidden = 1024
    layer = 4 * hidden * hidden + 3 * hidden * 4096  # q, k, v, o and the MLP of a Qwen3 layer this wide
    layers = max(1, round((host / 16 - 2 * 32000 * hidden) / layer))
    model = tmp_path / "model"
    model.mkdir()
    config = Qwen3Config(vocab_size=32000, hidden_size=hidden, intermediate_size=4096, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    (model / "config.json").write_text(json_module.dumps(config.to_dict()))
    (model / "model.safetensors").write_bytes(b"")  # never read: the preflight plans from config.json alone
    n = loading.parameter_count(config)
    assert host / 20 < n * 4 < host / 3  # the model in fp32: ~a sixteenth of the host

    def job(processes: int) -> Config:
        values = {"FT_MODEL": str(model), "FT_OUTPUT_DIR": str(tmp_path / "out"), "FT_PLATFORM": "none", "FT_GPU_MEMORY_GB": "100000",
                  "FT_DISTRIBUTED": "fsdp", "FT_MAX_STEPS": "10", "FT_SAVE_STEPS": "10", "FT_EVAL_STEPS": "10", "FT_SAVE_TOTAL_LIMIT": "1"}
        return Config(settings_table.load(values), cuda=True, precision=PRECISIONS["bf16-mixed"], processes_per_node=processes)

    with pytest.raises(ConfigError, match=r"while the model loads, each of the 8 processes on this node holds the whole model .* in float32") as refused:
        memory.preflight(job(8))
    assert refused.value.exit_code == 2 and "FT_NUM_NODES" in str(refused.value)
    memory.preflight(job(2))  # two copies fit, and so does the final gather
