"""The count of bad inputs and faults that docs/preemption-and-failures.md states is the suite's own count."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_the_failure_modes_page_states_how_many_bad_inputs_and_faults_the_suite_exercises():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "--faults", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    faults = [line.split("\t")[2] for line in listed.stdout.splitlines() if line.startswith("fault\t")]
    assert len(faults) == len(set(faults)), "each bad input or fault is named once"
    assert len(faults) >= 60
    page = ROOT / "docs" / "preemption-and-failures.md"
    stated = re.search(r"\*\*(\d+) distinct bad inputs and faults\*\*", page.read_text())
    assert stated, f"the Failure modes section of {page.name} states the count"
    assert int(stated.group(1)) == len(faults), f"the suite exercises {len(faults)}; update {page.name}"


def test_every_test_the_failure_modes_page_points_to_exists_and_names_what_it_cites():
    page = ROOT / "docs" / "preemption-and-failures.md"
    cited = set(re.findall(r"`?(tests/test_[a-z0-9_]+\.py)(?:::(test_[a-z0-9_]+))?", page.read_text()))
    assert cited, f"{page.name} points to the tests that exercise each failure"
    for path, name in sorted(cited):
        assert (ROOT / path).is_file(), f"{page.name} cites {path}, which does not exist (renamed or moved?)"
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{page.name} cites {path}::{name}, which is no longer there"
