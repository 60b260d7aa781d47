"""Several ranks agree on a stop flag without a GPU sync: each learns of a flag one exchange later, all at the same one."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, free_port

RANK_SCRIPT = """
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from trainer.core import ranks

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
ranks._flags = dist.new_group(backend="gloo")  # as ranks.start makes it
exchange, flagged_from = ranks.AnyRank(), int(sys.argv[1])
seen = [exchange.exchange(ranks.world_size() > 1 and int(os.environ["RANK"]) == 1 and step >= flagged_from) for step in range(5)]
print("SEEN " + json.dumps({"rank": int(os.environ["RANK"]), "seen": seen, "after_last": exchange.settle(),
                            "blocking": ranks.any_rank(int(os.environ["RANK"]) == 0)}), flush=True)
dist.destroy_process_group()  # no gloo thread left to end with the interpreter
"""


def _two_ranks(flagged_from: int) -> dict[int, dict]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(flagged_from)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )  # fmt: skip
        for rank in range(2)
    ]
    found = {}
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        line = next(line for line in out.splitlines() if line.startswith("SEEN "))
        result = json.loads(line.removeprefix("SEEN "))
        found[result["rank"]] = result
    return found


def test_a_flag_on_one_rank_is_seen_by_every_rank_at_the_same_later_step():
    """Rank 1 raises its flag at step 2: both ranks see it at step 3 (one exchange later, together), none before."""
    found = _two_ranks(flagged_from=2)
    assert found[0]["seen"] == found[1]["seen"] == [False, False, False, True, True]
    assert found[0]["after_last"] is found[1]["after_last"] is True  # the last step's exchange, waited for at the end
    assert found[0]["blocking"] is found[1]["blocking"] is True  # any_rank (once per save) answers at the call itself


def test_a_flag_raised_at_the_last_step_is_seen_by_every_rank_when_training_ends():
    found = _two_ranks(flagged_from=4)
    assert found[0]["seen"] == found[1]["seen"] == [False] * 5
    assert found[0]["after_last"] is found[1]["after_last"] is True



TIMEOUT_SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from trainer.core import config, ranks, settings

ranks.start(config.build(settings.load({"FT_PLATFORM": "none", "FT_COLLECTIVE_TIMEOUT_SECONDS": sys.argv[1]}), cuda=False, bf16_supported=False))
# The gloo backend's own timeout (no public getter; torch 2.13): what a collective waits for a rank that stopped answering.
timeouts = [group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in (dist.group.WORLD, ranks._flags)]
print("TIMEOUTS", *timeouts, flush=True)
dist.destroy_process_group()
"""


def test_the_collective_timeout_is_what_the_process_groups_wait_for_a_silent_rank():
    """FT_COLLECTIVE_TIMEOUT_SECONDS=75 (1800 by default) reaches the training group and the flags' group of every rank."""
    port = str(free_port())
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "LOCAL_WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen([sys.executable, "-c", TIMEOUT_SCRIPT, "75"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert "TIMEOUTS 75.0 75.0" in out.splitlines(), out
