"""Start the training process through accelerate, hand it the job's configuration, and supervise it.

accelerate's own `simple_launcher` turns every non-zero exit into 1 (or a CalledProcessError) and
does not forward signals, which would break the exit-code contract (75 = resume, 2 = do not retry)
and the save-on-SIGTERM path.  So we run the process ourselves, with the environment accelerate's launcher
would give it: for one process the training process adds it to its own environment (`accelerate_environment`,
from accelerate's `prepare_simple_launcher_cmd_env`), because importing accelerate here imports torch, about
2 s of every start in a process that trains nothing; for several, torchrun's command is built here from
accelerate's `prepare_multi_gpu_env` (torchrun imports torch anyway).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainer.core import ending
from trainer.core.config import VARIABLE
from trainer.core.errors import OutOfMemory, StepDownRestart, StopAbandoned
from trainer.core.files import read_json
from trainer.core.volume import Volume
from trainer.launch import watching


class StopForwarder:
    """Catches SIGTERM/SIGINT from the very start of entrypoint.py and forwards them to the training process.

    Installed before any slow import, so that a stop while torch loads is never lost: it is answered
    with exit 76 (nothing new was saved) instead of Python's default death by signal.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.child: subprocess.Popen | None = None
        self.group = False  # the child leads a process group (torchrun and its workers)
        self.abandoned = False
        self.ended = False  # ended by end_now: the volume is no longer this job's to write
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._forward)

    def _forward(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if self.child is None:
            return
        if self.group and len(self.received) > 1:
            # torchrun forwards one signal only; a second one means "give up the save": end every worker now.
            # The checkpoint being written has no manifest, so the last committed one stays the one to resume.
            self.abandoned = True
            os.killpg(self.child.pid, signal.SIGKILL)
            return
        self.child.send_signal(signum)  # the child saves a checkpoint and exits 75 (see trainer/checkpointing/preemption.py)

    def end_now(self) -> None:
        """End the training process at once, without a save: another job has taken over the volume (trainer/launch/lease.py)."""
        self.ended = True
        if self.child is not None and self.child.poll() is None:
            if self.group:
                os.killpg(self.child.pid, signal.SIGKILL)
            else:
                self.child.kill()


def single_process_command() -> tuple[list[str], dict[str, str]]:
    """The command and environment of one training process: `-m trainer` with this process's environment (the
    training process adds accelerate's launch variables itself: `accelerate_environment`)."""
    return [sys.executable, "-m", "trainer"], dict(os.environ)


def accelerate_environment(use_cpu: bool) -> dict[str, str]:
    """The variables `accelerate launch` sets for one process running `-m trainer` (ACCELERATE_USE_CPU, the mixed
    precision and dynamo choices, ...), minus what this process's environment already holds.  Called by the training
    process before accelerate's state is created, which reads them."""
    from accelerate.commands.launch import launch_command_parser, prepare_simple_launcher_cmd_env

    argv = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    argv += ["--cpu"] if use_cpu else []
    args = launch_command_parser().parse_args([*argv, "-m", "trainer"])
    args.use_cpu = use_cpu  # `accelerate launch` sets it from its config file; read unset without --cpu (accelerate 1.15)
    _, env = prepare_simple_launcher_cmd_env(args)
    _keep_thread_count(env)
    return {name: value for name, value in env.items() if os.environ.get(name) != value}


def _keep_thread_count(env: dict[str, str]) -> None:
    """accelerate writes the thread count it was given, str(None) when none was (libgomp then complains and
    falls back): the training processes keep the caller's OMP_NUM_THREADS, or their launcher's default."""
    env.pop("OMP_NUM_THREADS", None)
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]


def torchrun_command(config: Any) -> tuple[list[str], dict[str, str]]:
    """Several processes: the torchrun command and environment `accelerate launch --multi_gpu` would use.

    accelerate runs torchrun inside its own process (`multi_gpu_launcher`) and on CPU falls back to MPI; we take
    its environment (`prepare_multi_gpu_env`), read torchrun's arguments from what it resolved on `args`, and run
    torchrun as our child, for the same reason as above.  torchrun forwards SIGTERM to every worker once, and waits for them
    `--shutdown-timeout` seconds (the stop deadline and some) before it kills them.
    """
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    s = config.settings
    argv = ["--multi_gpu", "--num_processes", str(config.world_size), "--num_machines", str(s.num_nodes), "--machine_rank", str(s.node_rank)]
    argv += ["--main_process_ip", s.master_addr or "127.0.0.1", "--main_process_port", str(s.master_port), "--same_network"]
    argv += ["--mixed_precision", "no", "--dynamo_backend", "no", "--max_restarts", "0", "-m", "trainer"]
    args = launch_command_parser().parse_args(argv)
    env = prepare_multi_gpu_env(args)  # also sets nproc_per_node, nnodes, node_rank, master_addr/port on `args`
    _keep_thread_count(env)  # torchrun then gives each process 1 thread unless the caller chose
    if s.num_nodes == 1:  # one node: rank 0 is here, whatever FT_MASTER_ADDR says
        args.master_addr = "127.0.0.1"
    # accelerate 1.15's own mapping to torchrun (`_filter_args`, private) copies exactly these names from `args`; we read
    # them directly, so nothing private is called.  Unset ones are left to torchrun's defaults, as there.
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    for name in ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port", "max_restarts"):
        if getattr(args, name, None) not in (None, ""):
            cmd.append(f"--{name}={getattr(args, name)}")
    # The static rendezvous's store waits 600 s for the other nodes by default: a pod still pending or pulling the image
    # beyond that made the other exit 1 (a retry counted each time).  Several nodes wait FT_RENDEZVOUS_TIMEOUT_SECONDS.
    cmd.append(f"--rdzv_conf=timeout={s.rendezvous_timeout_seconds}")
    cmd += [f"--shutdown_timeout={s.stop_deadline_seconds + 30}", "--signals_to_handle=SIGTERM,SIGINT", "--module", "trainer"]
    return cmd, env


# What every training process runs with unless the caller set it (the caller's value always wins).
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # padding-free passes change size every step: segments grow in place
ALLOCATOR_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch 2.9+ reads the second first
NCCL_TRACE = "nccl_trace_rank_"  # the flight recorder appends the rank


def runtime_environment(config: Any, env: dict[str, str]) -> dict[str, str]:
    """`env` with the variables the training processes need beside the job's own: the CUDA allocator's expandable
    segments, and with several processes NCCL's warnings and its flight-recorder dump, written on the volume (its
    `logs/` folder, created here) when a collective times out, where the pod's /tmp would lose it."""
    added = {} if any(name in env for name in ALLOCATOR_NAMES) else dict(ALLOCATOR)
    if config.world_size > 1:
        added |= {"NCCL_DEBUG": "WARN", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
        if not {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"} & env.keys():
            logs = Volume(config.settings.output_dir).logs
            os.makedirs(logs, exist_ok=True)
            added["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(logs, NCCL_TRACE)
    return {name: value for name, value in added.items() if name not in env} | env


def run_under_accelerate(config: Any, stops: StopForwarder) -> int:
    """Run the job in a child process with `config` (trainer/core/config.py), forward stop signals, return its exit code.

    Several processes on one node: when they ended because one ran out of GPU memory and recorded the next plan
    down (trainer/model/stepdown.py), they are started again here at that plan, once per plan down; one process too,
    when it ended so (exit 75) on an out-of-memory error of cuBLAS, cuDNN or NCCL rather than torch's own."""
    several = config.world_size > 1
    cmd, env = torchrun_command(config) if several else single_process_command()
    root = str(Path(__file__).resolve().parents[2])  # the folder holding trainer/: `-m trainer` resolves from any working directory
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env[VARIABLE] = config.to_json()  # the child runs with what was validated here, not with its own reading of FT_*
    env[ending.LAUNCHER_PID] = str(os.getpid())
    env = runtime_environment(config, env)
    plans = Volume(config.settings.output_dir).memory_plan_file
    started_at: list[Any] = []  # the recorded plans the processes were restarted at: each once, so the restarts end
    while True:
        before = (read_json(plans) or {}).get("plan")
        returncode = _run_once(cmd, env, stops, several, watching.StepDownWatch(plans, before, config.settings.num_nodes) if several else None)
        if stops.received or stops.ended or stops.abandoned or returncode in (0, OutOfMemory.exit_code):
            break
        if not several and returncode != StepDownRestart.exit_code:  # one process steps down in itself, unless a library's error ended it
            break
        record = read_json(plans) or {}
        if record.get("plan") in (None, before):
            break  # not a step-down
        if config.settings.num_nodes > 1:  # the launchers of the other nodes are not ours to restart
            return ending.announce(StepDownRestart.exit_code, f"{_stepped_down(record, config.world_size, plans)}; this node ends so that the "
                                   "orchestrator's retry (exit 75, as after a stop) starts every node at that plan from the last committed checkpoint")
        if record["plan"] in started_at:
            break
        started_at.append(record["plan"])
        restarting, others = (
            (f"the {config.world_size} processes", "; the other processes were ended at once, and any error of theirs above follows from it")
            if several else ("it", "")
        )
        print(f"fulltune: {_stepped_down(record, config.world_size, plans)}: restarting {restarting} there (the same updates) "
              f"from the last committed checkpoint (step 0 before the first){others}", flush=True)
        ending.write_termination_message("")  # the ended processes' exit lines no longer say how the job ends
        stops.child = None  # a stop before the next start is answered as one while starting (76), never as the 0 of a start skipped
    if stops.ended:
        return returncode  # the caller says why (trainer/launch/lease.py)
    if stops.abandoned:
        return ending.announce(StopAbandoned.exit_code, "second stop signal before the checkpoint was committed; a "
                                                        "retry resumes from the last committed checkpoint")
    if stops.received and (stops.child is None or -returncode in stops.received):
        # The stop came before the training process had installed its handler: nothing new was
        # saved, the committed checkpoints are intact, and a retry resumes from them.
        why = f"stopped by {signal.Signals(stops.received[0]).name} while starting; a retry resumes from the last committed checkpoint"
        return ending.announce(StopAbandoned.exit_code, why)
    if returncode < 0:  # killed by a signal we did not send (e.g. SIGKILL from the kernel's OOM killer)
        return ending.announce(128 - returncode, f"training process killed by {signal.Signals(-returncode).name} (out of host memory?)")
    return returncode


def _run_once(cmd: list[str], env: dict[str, str], stops: StopForwarder, several: bool, watch: watching.StepDownWatch | None = None) -> int:
    """One start of the training process (torchrun and its ranks when `several`), to its end: the job's exit code."""
    outcome = tempfile.mkdtemp(prefix="fulltune-exit-")
    env = env | {ending.EXIT_FILE: os.path.join(outcome, "rank")}  # each local rank leaves its exit code there (torchrun reports only 1)
    returncode = 0
    if not stops.received and not stops.ended:
        stops.group = several
        stops.child = subprocess.Popen(cmd, env=env, start_new_session=several)  # several: its own group, to end the whole tree
        if stops.ended:  # between the check above and here
            stops.end_now()
        returncode = watching.wait(stops.child, outcome, watch)
    if several:
        returncode = _job_exit_code(outcome, returncode)
    shutil.rmtree(outcome, ignore_errors=True)
    return returncode


def _stepped_down(record: dict[str, Any], processes: int, path: str) -> str:
    """What the record of a step-down says happened, in words (its plans are [sequences, passes, checkpoint_every], with a
    1 after them when offloaded)."""
    failed = (record.get("out_of_memory") or [{}])[-1]
    peak = f" (measured peak {failed['measured_peak_bytes'] / 1e9:.1f} GB, {failed.get('measured_by')})" if failed.get("measured_peak_bytes") else ""
    where = f"on one of the {processes} processes" if processes > 1 else "in the training process"  # one: a library's error, not torch's (stepdown.py)
    return (f"out of GPU memory {where} with {_layout(failed.get('plan'))}{peak}; the next plan down, "
            f"{_layout(record['plan'])}, is recorded in {path}")


def _layout(plan: Any) -> str:
    if not (isinstance(plan, list) and len(plan) in (3, 4)):
        return str(plan)
    sequences, passes, every = plan[:3]
    recomputed = {0: "off", 1: "full (every layer)"}.get(every, f"selective (every {every} layers)")  # as trainer/model/estimate.py labels it
    offloaded = ", offloaded to host memory" if plan[3:] == [1] else ""
    return f"{sequences} sequences x {passes} passes per process, recomputation {recomputed}{offloaded}"


def _job_exit_code(folder: str, torchrun_code: int) -> int:
    """The job's code as this node's ranks recorded it (local rank 0's, unless it succeeded, or failed with 1 where another
    rank's code says why: the rank out of memory ends with 4 or 75, the others then fail with 1 on their lost peer),
    else torchrun's own (1 when a worker failed without recording, e.g. killed)."""
    codes = watching.recorded_codes(folder)
    failures = [code for _, code in sorted(codes.items()) if code]
    if codes.get(0) not in (None, 0, 1):
        return codes[0]
    return next((code for code in failures if code != 1), failures[0] if failures else torchrun_code)
