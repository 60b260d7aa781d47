"""The training process's environment, as trainer/launch/launcher.py hands it to the real child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from trainer.launch import launcher as launch

# As the training process starts (trainer/job.py): torch imported, then accelerate's launch variables added.
PROBE = ("import os, torch; from trainer.launch import launcher; os.environ.update(launcher.accelerate_environment(use_cpu=True)); "
         "print(repr(os.environ.get('OMP_NUM_THREADS')), torch.get_num_threads())")


def _training_process_sees(monkeypatch, omp_num_threads: str | None) -> subprocess.CompletedProcess:
    """Run the training process's command and environment with the job replaced by a probe."""
    if omp_num_threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    cmd, env = launch.single_process_command()
    assert cmd[1:] == ["-m", "trainer"], cmd
    return subprocess.run([cmd[0], "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_without_omp_num_threads_the_training_process_keeps_torchs_default_thread_count(monkeypatch):
    plain = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=plain, capture_output=True, text=True, timeout=120)
    result = _training_process_sees(monkeypatch, None)
    assert "Invalid value" not in result.stderr, result.stderr  # libgomp's complaint about OMP_NUM_THREADS=None
    assert result.stdout.split() == ["None", default.stdout.strip()], result.stdout


def test_the_callers_omp_num_threads_reaches_the_training_process(monkeypatch):
    result = _training_process_sees(monkeypatch, "1")
    assert result.stdout.split() == ["'1'", "1"], result.stdout + result.stderr


def _recorded(tmp_path, codes: dict[int, str]) -> str:
    """The outcome folder as the local ranks leave it: one `rank.<local rank>` file each, holding its exit code."""
    for rank, text in codes.items():
        (tmp_path / f"rank.{rank}").write_text(text, encoding="utf-8")
    return str(tmp_path)


@pytest.mark.parametrize(
    ("codes", "torchrun_code", "expected"),
    [
        ({}, 0, 0),  # nobody recorded: torchrun's own code
        ({}, 1, 1),  # a worker killed before recording: torchrun says 1
        ({0: "0", 1: "0"}, 0, 0),
        ({0: "0", 1: "0"}, 1, 1),  # all recorded success but torchrun failed (e.g. a rank was killed after recording)
        ({0: "5", 1: "0"}, 1, 5),  # rank 0's failure is the job's
        ({0: "0", 1: "5"}, 1, 5),  # rank 0 succeeded, another failed: that one's
        ({0: "2", 1: "5"}, 1, 2),  # both failed: rank 0's wins
        ({0: "0", 1: "6", 2: "5"}, 1, 6),  # rank 0 succeeded: the lowest failing rank's
        ({0: "0", 2: "5", 10: "6"}, 1, 5),  # ranks sort as numbers, not as text ("10" < "2")
        ({0: "", 1: "0"}, 1, 1),  # an empty record is a failure (1), not a success
        ({1: "75"}, 1, 75),  # rank 0 did not record, another did
        ({0: "1", 1: "4"}, 1, 4),  # rank 1 out of memory at the smallest plan, rank 0 then failed on its lost peer: 4, not 1
        ({0: "1", 1: "1", 2: "75"}, 1, 75),  # rank 2 stepped down, the others lost it: the code that says why
    ],
)
def test_the_job_exit_code_follows_local_rank_0_then_the_first_failing_rank_then_torchrun(tmp_path, codes, torchrun_code, expected):
    assert launch._job_exit_code(_recorded(tmp_path, codes), torchrun_code) == expected


# Stands in for torchrun and its two ranks: start n records FAKE_PLANS[n] as the next plan down and fails as a step-down does
# (rank 1 out of memory: 75; rank 0 on its lost peer: 1); once the list is used up, both ranks succeed.
FAKE_TORCHRUN = """
import json, os, sys
volume, starts = sys.argv[1], sys.argv[2]
with open(starts, "a") as f:
    f.write("x")
n, plans, exit_file = len(open(starts).read()) - 1, json.loads(os.environ["FAKE_PLANS"]), os.environ["FULLTUNE_EXIT_FILE"]
if n < len(plans):
    os.makedirs(os.path.join(volume, ".fulltune"), exist_ok=True)
    record = {"plan": plans[n], "out_of_memory": [{"plan": [4, 1, 0], "measured_peak_bytes": 8.1e10, "measured_by": "torch.cuda.max_memory_allocated"}]}
    with open(os.path.join(volume, ".fulltune", "memory-plan.json"), "w") as f:
        json.dump(record, f)
codes = ("1", "75") if n < len(plans) else ("0", "0")
for rank, code in enumerate(codes):
    with open(f"{exit_file}.{rank}", "w") as f:
        f.write(code)
sys.exit(int(codes[0] != "0"))
"""


@pytest.mark.parametrize(
    ("nodes", "plans", "code", "starts"),
    [
        (1, [[2, 2, 0]], 0, 2),  # one step down: the launcher starts the processes again, the job ends 0
        (1, [[2, 2, 0], [1, 4, 0]], 0, 3),  # one restart per plan down
        (1, [[2, 2, 0], [1, 4, 0], [2, 2, 0]], 75, 3),  # a plan it already restarted at: no third restart, the retry's 75
        (2, [[2, 2, 0]], 75, 1),  # several nodes: the other launchers are not this one's to restart, the orchestrator retries
        (1, [], 0, 1),
    ],
)
def test_a_step_down_of_several_processes_restarts_them_on_one_node_once_per_plan_and_exits_75_across_nodes(
    tmp_path, monkeypatch, capsys, nodes, plans, code, starts
):
    import json
    import signal

    from trainer.core import config as job_config
    from trainer.core import settings as settings_table

    script, counter, volume = tmp_path / "torchrun.py", tmp_path / "starts", tmp_path / "volume"
    script.write_text(FAKE_TORCHRUN, encoding="utf-8")
    values = {"FT_OUTPUT_DIR": str(volume), "FT_NUM_PROCESSES": "2", "FT_DISTRIBUTED": "ddp", "FT_TERMINATION_MESSAGE_PATH": str(tmp_path / "termination")}
    values |= {"FT_NUM_NODES": "2", "FT_NODE_RANK": "0", "FT_MASTER_ADDR": "127.0.0.1"} if nodes > 1 else {}
    config = job_config.build(settings_table.load(values), cuda=False, bf16_supported=False)
    monkeypatch.setattr(launch, "torchrun_command", lambda _: ([sys.executable, str(script), str(volume), str(counter)], dict(os.environ)))
    monkeypatch.setenv("FAKE_PLANS", json.dumps(plans))
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert launch.run_under_accelerate(config, launch.StopForwarder()) == code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out, err = capsys.readouterr()
    assert len(counter.read_text()) == starts
    assert out.count("restarting the 2 processes there") == (starts - 1 if nodes == 1 else 0), out
    if nodes > 1:
        line = next(line for line in err.splitlines() if line.startswith("fulltune: exit 75: "))
        assert "out of GPU memory on one of the 4 processes with 4 sequences x 1 passes per process, recomputation off (measured peak 81.0 GB" in line, line
        assert "2 sequences x 2 passes per process, recomputation off, is recorded in" in line and "orchestrator's retry" in line, line


@pytest.mark.parametrize("use_cpu", [True, False])
def test_the_training_process_gets_the_variables_accelerate_launch_sets_on_cpu_and_on_a_gpu(monkeypatch, use_cpu):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    added = launch.accelerate_environment(use_cpu=use_cpu)
    assert added["ACCELERATE_USE_CPU"] == str(use_cpu)
    assert (added["ACCELERATE_MIXED_PRECISION"], added["ACCELERATE_DYNAMO_BACKEND"]) == ("no", "NO")  # precision is the job's own (FT_PRECISION)
    assert "OMP_NUM_THREADS" not in added  # never "None" (see above)


def _config(tmp_path, **values: str):
    from trainer.core import config as job_config
    from trainer.core import settings as settings_table

    return job_config.build(settings_table.load({"FT_OUTPUT_DIR": str(tmp_path / "volume"), **values}), cuda=False, bf16_supported=False)


@pytest.mark.parametrize(("values", "timeout"), [({}, 1800), ({"FT_RENDEZVOUS_TIMEOUT_SECONDS": "7200"}, 7200)])
def test_the_nodes_wait_for_each_other_at_the_rendezvous_for_the_rendezvous_timeout(tmp_path, values, timeout):
    """torchrun's static rendezvous gives the other nodes 600 s unless its `timeout` is set: a pod still pending or pulling its
    image after that made the first exit 1 (tests/test_scale_out.py runs a node whose peers never come)."""
    config = _config(tmp_path, FT_NUM_PROCESSES="2", FT_DISTRIBUTED="ddp", FT_NUM_NODES="2", FT_NODE_RANK="1", FT_MASTER_ADDR="10.0.0.1", **values)
    cmd, _ = launch.torchrun_command(config)
    assert f"--rdzv_conf=timeout={timeout}" in cmd and "--nnodes=2" in cmd and "--master_addr=10.0.0.1" in cmd, cmd
    assert timeout >= 1800


def test_training_processes_get_expandable_segments_and_several_nccls_warnings_and_its_dump_on_the_volume_unless_the_caller_set_them(tmp_path):
    one = launch.runtime_environment(_config(tmp_path), {"PATH": "/bin"})
    assert one == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # one process: no NCCL
    assert not (tmp_path / "volume" / "logs").exists()
    several = _config(tmp_path, FT_NUM_PROCESSES="2", FT_DISTRIBUTED="ddp")
    env = launch.runtime_environment(several, {})
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_DEBUG": "WARN", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "volume" / "logs" / "nccl_trace_rank_")}
    assert (tmp_path / "volume" / "logs").is_dir()  # the flight recorder writes its files there, it creates no folder
    own = {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync", "NCCL_DEBUG": "INFO", "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}
    assert launch.runtime_environment(several, own) == own | {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # torch reads PYTORCH_ALLOC_CONF first
    assert launch.runtime_environment(several, {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8"})["PYTORCH_CUDA_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.8")


@pytest.mark.parametrize(
    ("nodes", "codes", "plan", "ends"),
    [
        (1, {1: "75"}, [2, 2, 0], True),  # a step-down: a rank's 75 beside a new plan
        (1, {1: "75"}, [4, 1, 0], False),  # 75 with the plan unchanged: a stop after its commit, the others still saving
        (1, {1: "1"}, [2, 2, 0], False),  # 1: not the rank that ran out (it has not recorded yet)
        (1, {0: "4"}, [4, 1, 0], True),  # out of memory at the smallest plan: the job ends with 4 whatever the others do
        (2, {}, [2, 2, 0], True),  # another node's rank stepped down: the new plan on the shared volume is the sign
        (2, {}, [4, 1, 0], False),
        (1, {}, None, False),  # no record at all
    ],
)
def test_the_launcher_ends_its_ranks_when_one_recorded_an_out_of_memory_step_down_and_only_then(tmp_path, nodes, codes, plan, ends):
    """What trainer/launch/watching.py reads while the ranks run: their exit records and the plan recorded on the volume
    (tests/test_stepdown.py runs it with a rank blocked as in an NCCL collective)."""
    import json

    from trainer.launch import watching

    plans = tmp_path / "memory-plan.json"
    watch = watching.StepDownWatch(str(plans), [4, 1, 0], nodes)
    (tmp_path / "outcome").mkdir()
    outcome = _recorded(tmp_path / "outcome", codes)
    assert watch(outcome) is ("4" in codes.values())  # before any plan is recorded on the volume, only a 4 ends them
    if plan is not None:
        plans.write_text(json.dumps({"plan": plan}))
    assert watch(outcome) is ends
