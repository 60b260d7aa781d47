"""Start the training process through accelerate and supervise it.

accelerate's own `simple_launcher` turns every non-zero exit into 1 (or a CalledProcessError) and
does not forward signals, which would break the exit-code contract (75 = resume, 2 = do not retry)
and the save-on-SIGTERM path.  So we let accelerate build the command and environment
(`prepare_simple_launcher_cmd_env`) and run the process ourselves.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any


def accelerate_command(use_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The command and environment `accelerate launch` would use for one process running `-m trainer`."""
    from accelerate.commands.launch import launch_command_parser, prepare_simple_launcher_cmd_env

    argv = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    argv += ["--cpu"] if use_cpu else []
    args = launch_command_parser().parse_args([*argv, "-m", "trainer"])
    return prepare_simple_launcher_cmd_env(args)


def run_under_accelerate(config: Any) -> int:
    """Run the job in a child process, forward stop signals to it, and return its exit code."""
    import torch

    cmd, env = accelerate_command(use_cpu=not torch.cuda.is_available())
    child = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)  # the child saves a checkpoint and exits 75 (see trainer/preemption.py)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    returncode = child.wait()
    if returncode < 0:  # killed by a signal we did not forward (e.g. SIGKILL from the OOM killer)
        print(f"fulltune: training process killed by signal {-returncode}", file=sys.stderr, flush=True)
        return 128 - returncode
    return returncode
