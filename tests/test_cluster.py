"""Several nodes: what each cluster launcher's variables make of the settings, and what explicit FT_* keep."""

from __future__ import annotations

import pytest

from conftest import job_env, run_job
from trainer.core import cluster, settings
from trainer.core.errors import ConfigError

TRAINJOB = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}


def test_a_kubeflow_trainjobs_variables_place_the_node():
    loaded = settings.load(TRAINJOB | {"FT_PLATFORM": "none"})
    assert (loaded.num_nodes, loaded.num_processes, loaded.node_rank, loaded.master_addr, loaded.master_port) == (2, 8, 1, "job-node-0-0.job", 29500)


def test_a_non_numeric_processes_per_node_leaves_the_choice_to_the_visible_gpus():
    assert settings.load(TRAINJOB | {"PET_NPROC_PER_NODE": "auto", "FT_PLATFORM": "none"}).num_processes == 0


def test_a_pytorchjob_or_volcano_pod_is_a_node_of_world_size_pods():
    loaded = settings.load({"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "FT_PLATFORM": "none"})
    assert (loaded.num_nodes, loaded.node_rank, loaded.master_addr, loaded.master_port) == (4, 3, "job-master-0", 23456)


def test_an_indexed_job_gives_the_rank_and_the_manifest_the_rest():
    loaded = settings.load({"JOB_COMPLETION_INDEX": "1", "FT_NUM_NODES": "2", "FT_MASTER_ADDR": "fulltune-0.fulltune-nodes", "FT_PLATFORM": "none"})
    assert (loaded.num_nodes, loaded.node_rank, loaded.master_addr) == (2, 1, "fulltune-0.fulltune-nodes")


def test_explicit_ft_variables_win_over_the_cluster_and_the_log_says_so():
    name, implied = cluster.detect(TRAINJOB | {"FT_NODE_RANK": "0"})
    assert name == "kubeflow-trainer" and "FT_NODE_RANK" not in implied
    assert "FT_NODE_RANK set explicitly (kept)" in cluster.describe(name, implied)
    assert settings.load(TRAINJOB | {"FT_NODE_RANK": "0", "FT_PLATFORM": "none"}).node_rank == 0


@pytest.mark.faults
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FT_NUM_NODES": "2"}, "FT_MASTER_ADDR=<unset>: must name node 0"),
        ({"FT_NUM_NODES": "2", "FT_MASTER_ADDR": "h", "FT_NODE_RANK": "2"}, "FT_NODE_RANK='2': must be below FT_NUM_NODES=2"),
        ({"FT_DISTRIBUTED": "zero3"}, "FT_DISTRIBUTED='zero3': not a valid choice"),
    ],
)
def test_an_impossible_place_in_the_cluster_exits_2_naming_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        settings.load(env | {"FT_PLATFORM": "none"})


def test_the_first_lines_name_the_cluster_and_what_it_filled_in(tmp_path):
    result = run_job(job_env(tmp_path / "volume", **TRAINJOB, FT_MAX_STEPS="-1"), timeout=60)  # exits 2 at once: only the start-up lines
    assert result.returncode == 2
    assert "fulltune: cluster kubeflow-trainer detected by PET_NNODES: FT_NUM_NODES=2 from PET_NNODES" in result.stdout
    assert "FT_NODE_RANK=1 from PET_NODE_RANK" in result.stdout
