"""requirements.lock, the constraints the image and CI install with, agrees with requirements.txt and with what the
tests run on: a pin changed in one file and not the other would build an image the tests never saw."""

from __future__ import annotations

import re
from importlib import metadata

from conftest import ROOT


def _pins(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    pairs = (line.split("#")[0].strip().split("==") for line in lines)
    return {_normal(pair[0]): pair[1] for pair in pairs if len(pair) == 2}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lock_holds_every_pin_of_requirements_txt_at_its_version():
    pins, lock = _pins("requirements.txt"), _pins("requirements.lock")
    assert "torch" not in lock  # installed first, the CUDA build in the image and the CPU build in CI
    assert {name: version for name, version in pins.items() if name != "torch" and lock.get(name) != version} == {}


def test_the_tests_run_on_the_locked_versions():
    """CI installs with `-c requirements.lock` (.ci/run); a machine set up otherwise is told which packages differ."""
    differ = {}
    for name, version in _pins("requirements.lock").items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # a package of the image's set this machine's venv does not need
        if installed != version:
            differ[name] = f"{installed} installed, {version} locked"
    assert differ == {}


def test_every_third_party_module_fulltune_imports_is_pinned_in_requirements_txt():
    """A module imported by trainer/ or entrypoint.py, not pinned, takes whatever version another package pulls in (tqdm
    came in through lm-eval and transformers while evaluation/harness.py patched it)."""
    import ast
    import sys

    distributions = metadata.packages_distributions()  # import name -> the distributions that provide it
    pins = set(_pins("requirements.txt"))
    unpinned = {}
    for path in [ROOT / "entrypoint.py", *sorted((ROOT / "trainer").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"trainer", "__future__"}:
                provided = {_normal(d) for d in distributions.get(top, [])}
                if not provided & pins:
                    unpinned.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    assert {top: sorted(where) for top, where in unpinned.items()} == {}, "pin them in requirements.txt (and requirements.lock)"
