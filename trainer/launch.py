"""Start the training process through accelerate and supervise it.

accelerate's own `simple_launcher` turns every non-zero exit into 1 (or a CalledProcessError) and
does not forward signals, which would break the exit-code contract (75 = resume, 2 = do not retry)
and the save-on-SIGTERM path.  So we let accelerate build the command and environment
(`prepare_simple_launcher_cmd_env`) and run the process ourselves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from trainer.errors import StopAbandoned, write_termination_message


def accelerate_command(use_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The command and environment `accelerate launch` would use for one process running `-m trainer`."""
    from accelerate.commands.launch import launch_command_parser, prepare_simple_launcher_cmd_env

    argv = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    argv += ["--cpu"] if use_cpu else []
    args = launch_command_parser().parse_args([*argv, "-m", "trainer"])
    cmd, env = prepare_simple_launcher_cmd_env(args)
    # accelerate writes the thread count it was given, str(None) when none was (libgomp then complains and
    # falls back): the training process keeps the caller's OMP_NUM_THREADS, or torch's default without one.
    env.pop("OMP_NUM_THREADS", None)
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return cmd, env


def run_under_accelerate(config: Any) -> int:
    """Run the job in a child process, forward stop signals to it, and return its exit code."""
    child: subprocess.Popen | None = None
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if child is not None:
            child.send_signal(signum)  # the child saves a checkpoint and exits 75 (see trainer/preemption.py)

    for signum in (signal.SIGTERM, signal.SIGINT):  # before the slow imports: a stop is never lost
        signal.signal(signum, forward)

    import torch

    cmd, env = accelerate_command(use_cpu=not torch.cuda.is_available())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `-m trainer` resolves from any working directory
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if not received:
        child = subprocess.Popen(cmd, env=env)
        returncode = child.wait()
    if received and (child is None or -returncode in received):
        # The stop came before the training process had installed its handler: nothing new was
        # saved, the committed checkpoints are intact, and a retry resumes from them.
        return _report(StopAbandoned.exit_code, f"stopped by {signal.Signals(received[0]).name} while starting; a retry resumes from the last committed checkpoint")
    if returncode < 0:  # killed by a signal we did not send (e.g. SIGKILL from the kernel's OOM killer)
        return _report(128 - returncode, f"training process killed by {signal.Signals(-returncode).name} (out of host memory?)")
    return returncode


def _report(code: int, why: str) -> int:
    print(f"fulltune: exit {code}: {why}", file=sys.stderr, flush=True)
    write_termination_message(f"exit {code}: {why}")
    return code
