"""Start the training process through accelerate, hand it the job's configuration, and supervise it.

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

from trainer.config import VARIABLE
from trainer.errors import StopAbandoned, write_termination_message


class StopForwarder:
    """Catches SIGTERM/SIGINT from the very start of entrypoint.py and forwards them to the training process.

    Installed before any slow import, so that a stop while torch loads is never lost: it is answered
    with exit 76 (nothing new was saved) instead of Python's default death by signal.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.child: subprocess.Popen | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._forward)

    def _forward(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if self.child is not None:
            self.child.send_signal(signum)  # the child saves a checkpoint and exits 75 (see trainer/preemption.py)


def accelerate_command(use_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The command and environment `accelerate launch` would use for one process running `-m trainer`."""
    from accelerate.commands.launch import launch_command_parser, prepare_simple_launcher_cmd_env

    argv = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    argv += ["--cpu"] if use_cpu else []
    args = launch_command_parser().parse_args([*argv, "-m", "trainer"])
    return prepare_simple_launcher_cmd_env(args)


def run_under_accelerate(config: Any, stops: StopForwarder) -> int:
    """Run the job in a child process with `config` (trainer/config.py), forward stop signals, return its exit code."""
    cmd, env = accelerate_command(use_cpu=not config.cuda)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `-m trainer` resolves from any working directory
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env[VARIABLE] = config.to_json()  # the child runs with what was validated here, not with its own reading of FT_*
    returncode = 0
    if not stops.received:
        stops.child = subprocess.Popen(cmd, env=env)
        returncode = stops.child.wait()
    if stops.received and (stops.child is None or -returncode in stops.received):
        # The stop came before the training process had installed its handler: nothing new was
        # saved, the committed checkpoints are intact, and a retry resumes from them.
        why = f"stopped by {signal.Signals(stops.received[0]).name} while starting; a retry resumes from the last committed checkpoint"
        return _report(StopAbandoned.exit_code, why)
    if returncode < 0:  # killed by a signal we did not send (e.g. SIGKILL from the kernel's OOM killer)
        return _report(128 - returncode, f"training process killed by {signal.Signals(-returncode).name} (out of host memory?)")
    return returncode


def _report(code: int, why: str) -> int:
    print(f"fulltune: exit {code}: {why}", file=sys.stderr, flush=True)
    write_termination_message(f"exit {code}: {why}")
    return code
