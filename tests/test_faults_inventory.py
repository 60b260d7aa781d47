"""The README's count of the bad inputs and faults the suite feeds the job is the suite's own count."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_the_readme_states_how_many_bad_inputs_and_faults_the_suite_exercises():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--faults", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    faults = [line.split("\t")[2] for line in listed.stdout.splitlines() if line.startswith("fault\t")]
    assert len(faults) == len(set(faults)), "each bad input or fault is named once"
    assert len(faults) >= 60
    stated = re.search(r"\*\*(\d+) distinct bad inputs and faults\*\*", (ROOT / "README.md").read_text())
    assert stated, "the README's Failure modes section states the count"
    assert int(stated.group(1)) == len(faults), f"the suite exercises {len(faults)}; update the README"
