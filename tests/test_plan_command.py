"""`python entrypoint.py plan`: the memory plan for the configured FT_* and a card, from config.json alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

QWEN3_8B = ROOT / "bench" / "configs" / "qwen3-8b"


def plan(*args, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FT_")} | {"HF_HUB_OFFLINE": "1", "FT_PLATFORM": "none"} | env
    return subprocess.run([sys.executable, "entrypoint.py", "plan", *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)


def test_plan_prints_the_layout_recomputation_and_peak_for_a_card_as_json_without_torch():
    probe = (
        "import runpy, sys\n"
        "sys.argv = ['entrypoint.py', 'plan', '--card', 'h200-141gb', '--json']\n"
        "try:\n    runpy.run_path('entrypoint.py', run_name='__main__')\n"
        "except SystemExit as done:\n    print('torch' in sys.modules, done.code)\n"
    )
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FT_")} | {"FT_MODEL": str(QWEN3_8B), "FT_MAX_LENGTH": "2048", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    data, (torch_loaded, code) = json.loads(result.stdout.splitlines()[0]), result.stdout.splitlines()[1].split()
    assert (torch_loaded, code) == ("False", "0"), result.stderr
    assert data["card"] == "h200-141gb" and data["capacity_gb"] == 150.8 and data["fits"]
    assert data["parameters"] == 8_190_735_360 and data["precision"] == "bf16-mixed"
    assert data["sequences_per_pass"] * data["passes_per_step"] == 8 and data["recomputation"].startswith("full")
    assert sum(data["breakdown_gb"].values()) == pytest.approx(data["peak_gb"], abs=0.05)
    assert {"weights", "optimizer", "activations", "workspace"} <= set(data["breakdown_gb"])


def test_plan_as_text_names_the_layout_and_each_component():
    result = plan("--card", "h100-80gb", FT_MODEL=str(ROOT / "bench" / "qwen3-4b-config.json"), FT_MAX_LENGTH="2048")
    assert result.returncode == 0, result.stderr
    assert "8 sequences x 1 passes per optimizer step, one process" in result.stdout
    assert "recomputation: full (every layer)" in result.stdout and "fits" in result.stdout
    assert "in the backward end" in result.stdout and "tied gradient" in result.stdout and "weights" in result.stdout


@pytest.mark.parametrize("card", ["h100-80gb", "h200-141gb"])
def test_plan_says_what_the_reference_job_writes_its_checkpoint_the_volume_and_the_write_time(card):
    reference = plan("--card", card, FT_MODEL=str(ROOT / "bench" / "qwen3-4b-config.json"))
    assert reference.returncode == 0, reference.stderr
    assert "checkpoint:    48.3 GB (weights + optimizer states); final model 8.0 GB" in reference.stdout
    assert "volume:        at least 209 GB (195 GiB): 4 checkpoints at once" in reference.stdout
    assert "one write:     ~241 s at 200 MB/s" in reference.stdout
    faster = json.loads(plan("--card", card, "--json", "--write-mb-s", "1000", FT_MODEL=str(ROOT / "bench" / "qwen3-4b-config.json"),
                             FT_SAVE_TOTAL_LIMIT="1").stdout)
    assert (faster["write_seconds"], faster["checkpoints_at_once"]) == (48, 3)  # 48.3 GB at 1 GB/s; 1 kept + the best + one written
    assert faster["volume_gb"] == pytest.approx(3 * 48.3 + 8.0 + 8.0, abs=0.2)


def test_a_model_too_big_for_the_card_exits_2_with_the_processes_that_fit_it():
    result = plan("--card", "h100-80gb", FT_MODEL=str(QWEN3_8B), FT_MAX_LENGTH="2048")
    assert result.returncode == 2
    assert "does NOT fit" in result.stdout and "FT_NUM_PROCESSES=4 (FSDP" in result.stdout
    four = plan("--card", "h100-80gb", "--json", FT_MODEL=str(QWEN3_8B), FT_MAX_LENGTH="2048", FT_NUM_PROCESSES="4")
    assert four.returncode == 0, four.stdout + four.stderr
    assert json.loads(four.stdout)["strategy"] == "fsdp"


def test_ft_gpu_memory_gb_is_the_card_when_no_card_is_named():
    result = plan("--json", FT_MODEL=str(QWEN3_8B), FT_GPU_MEMORY_GB="400")
    assert result.returncode == 0 and json.loads(result.stdout)["capacity_gb"] == 400.0


def test_a_hub_id_without_the_hub_exits_2_saying_to_give_a_local_config():
    result = plan(FT_MODEL="Qwen/Qwen3-4B")
    assert result.returncode == 2
    assert "FT_MODEL='Qwen/Qwen3-4B'" in result.stderr and "local folder" in result.stderr and "Traceback" not in result.stderr


def test_an_unknown_card_or_setting_exits_2_naming_it():
    card = plan("--card", "h100", FT_MODEL=str(QWEN3_8B))
    assert card.returncode == 2 and "--card 'h100'" in card.stderr and "h100-80gb" in card.stderr
    setting = plan(FT_MODEL=str(QWEN3_8B), FT_MAX_LENGTH="many")
    assert setting.returncode == 2 and "FT_MAX_LENGTH" in setting.stderr


def test_a_hub_id_while_the_hub_does_not_answer_exits_2_at_once_saying_to_give_a_local_config():
    from tests.conftest import free_port

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("FT_", "HF_HUB_OFFLINE"))}
    environ |= {"FT_PLATFORM": "none", "FT_MODEL": "Qwen/Qwen3-4B", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    result = subprocess.run([sys.executable, "entrypoint.py", "plan"], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "does not answer" in result.stderr and "local folder" in result.stderr and "bench/configs" in result.stderr
    assert "Retrying" not in result.stderr and "Traceback" not in result.stderr  # huggingface_hub's five retries took 24 s


def test_the_reference_job_on_an_h100_recomputes_every_layer_in_one_pass_and_shows_two_runners_up():
    """FT_MAX_LENGTH=4096, no data prepared: 8 x 1 with every layer recomputed (75.4 GB) is the fastest that fits 85.5 GB;
    the runners-up split the step (4 x 2, 2 x 4), each slower by its passes' fixed cost."""
    model = str(ROOT / "bench" / "qwen3-4b-config.json")
    text = plan("--card", "h100-80gb", FT_MODEL=model).stdout
    assert "8 sequences x 1 passes per optimizer step" in text and "recomputation: full (every layer)" in text
    assert "step time:     ~" in text and "h100 speeds" in text and "sequences of 4096 tokens (FT_MAX_LENGTH" in text
    assert "runners-up:    4 x 2, recomputation full (every layer)" in text and "2 x 4, recomputation full (every layer)" in text
    data = json.loads(plan("--card", "h100-80gb", "--json", FT_MODEL=model).stdout)
    assert (data["sequences_per_pass"], data["checkpoint_every"], data["offload"], data["cost_device"]) == (8, 1, False, "h100")
    assert [(r["sequences_per_pass"], r["checkpoint_every"]) for r in data["runners_up"]] == [(4, 1), (2, 1)]
    assert all(r["relative_step_time"] > 1 and r["peak_gb"] <= data["capacity_gb"] for r in data["runners_up"])


def test_the_reference_job_on_an_h200_takes_the_layout_the_cost_model_ranks_fastest():
    """The H200's 150.8 GB fit 1 x 8 without recomputation (116.7 GB), but 2 x 4 recomputing 1 layer of 36 is faster by the
    model: four passes' fixed cost saved outweighs one layer's forward again (docs/memory-plan.md)."""
    model = str(ROOT / "bench" / "qwen3-4b-config.json")
    data = json.loads(plan("--card", "h200-141gb", "--json", FT_MODEL=model).stdout)
    assert (data["sequences_per_pass"], data["passes_per_step"], data["checkpoint_every"], data["cost_device"]) == (2, 4, 36, "h200")
    assert [(r["sequences_per_pass"], r["checkpoint_every"]) for r in data["runners_up"]] == [(4, 2), (1, 0)]
    assert data["runners_up"][1]["peak_gb"] == pytest.approx(116.7, abs=0.1)
    assert all(r["relative_step_time"] >= 1 for r in data["runners_up"])
    text = plan("--card", "h200-141gb", FT_MODEL=model).stdout
    assert "2 sequences x 4 passes per optimizer step" in text and "recomputation: selective (every 36 layers: 1 of 36)" in text
    assert "runners-up:    4 x 2, recomputation selective (every 2 layers: 18 of 36)" in text and "1 x 8, recomputation off: ~116.7 GB" in text
    # The reference data's ~1.1k-token mean sequence (Capybara): 4 x 2 recomputing every 2nd layer, 8 x 1 full close behind
    shorter = json.loads(plan("--card", "h200-141gb", "--json", "--mean-tokens", "1100", FT_MODEL=model).stdout)
    assert (shorter["sequences_per_pass"], shorter["checkpoint_every"], shorter["tokens_from"]) == (4, 2, "--mean-tokens")
