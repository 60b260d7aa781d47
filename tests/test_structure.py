"""One owner per concern: the settings are parsed once, MLflow has one module, the volume's layout has one.

These rules are what keep the job correct once it runs as several processes: a second parse could
disagree with the first, a second MLflow caller could open a second run, a second spelling of a path
could write where nothing reads.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from conftest import ROOT, job_env, run_job, with_faults

CODE = sorted((ROOT / "trainer").rglob("*.py")) + [ROOT / "entrypoint.py"]
LAYOUT = {"checkpoints", "incomplete", "final", "mlflow", ".fulltune", "data-cache", "data-report.txt", "eval-samples.jsonl", "report.html", "demo",
          "status.json", "fingerprint.json", "mlflow_run.json", "lease.json", "lease.lock", "unsent-tracking.json", "memory-plan.json"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _name(path: Path) -> str:
    return path.relative_to(ROOT / "trainer").as_posix() if path.is_relative_to(ROOT / "trainer") else path.name


# The folders of trainer/ in the order their imports point: a folder imports only from folders before it (and itself).
# launch/ and core/ run before torch is imported; serving/ is copied into the saved model and imports nothing of fulltune;
# telemetry/ (what the cluster sees) is fed by the job and the progress callback and imports only core/, and no torch.
# job.py and sft_trainer.py (the trainer it builds) sit on top: no folder imports them.
TOP = {"job": 9, "sft_trainer": 9}
LAYERS = {"core": 0, "launch": 1, "data": 1, "telemetry": 1, "model": 2, "checkpointing": 3, "tracking": 4, "publishing": 5, "evaluation": 5,
          "console": 6, "report": 6}


def test_the_folders_imports_point_one_way():
    edges = set()
    for path in CODE:
        name = _name(path)
        if "/" not in name:
            continue
        source = name.split("/")[0]
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "trainer" and len(parts) > 1 and parts[1] != source and parts[1] in LAYERS | {"serving": 0} | TOP:
                edges.add((source, parts[1], name))
    backwards = sorted((name, target) for source, target, name in edges
                       if target in TOP or source == "serving" or (source in LAYERS and LAYERS.get(target, -1) >= LAYERS[source]))
    assert backwards == []
    assert {(source, target) for source, target, _ in edges if source == "launch"} <= {("launch", "core")}
    assert {(source, target) for source, target, _ in edges if source == "telemetry"} <= {("telemetry", "core")}
    # tracking/ is the MLflow client: it knows the configuration and the volume, not the model or the data
    assert sorted((name, target) for source, target, name in edges if source == "tracking" and target in ("model", "data")) == []


def test_no_module_imports_itself_back_in_core():
    """core/ is read by everything: an import circle there (once settings.py and refusals.py, one importing the other
    inside a function) works only as long as nobody moves an import to the top of a file."""
    core = {path.stem: path for path in (ROOT / "trainer" / "core").glob("*.py") if path.stem != "__init__"}
    edges = {}
    for name, path in core.items():
        targets, tree = set(), ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                       for n in ast.walk(block)}  # annotations only: never imported when the code runs
        for node in (n for n in ast.walk(tree) if id(n) not in typing_only):  # function-level imports too
            if isinstance(node, ast.ImportFrom) and node.module == "trainer.core":
                targets |= {alias.name for alias in node.names if alias.name in core}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer.core."):
                targets.add(node.module.split(".")[2])
        edges[name] = targets - {name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(t == goal or (t not in seen and reaches(t, goal, seen | {t})) for t in edges.get(start, ()))

    assert sorted(name for name in core if reaches(name, name, {name})) == []


def test_only_the_tracking_folder_imports_mlflow():
    """serving/ is the one exception: it is no part of the job but the saved model's code, which MLflow copies into
    the model and runs in the serving process (pyfunc.py subclasses mlflow.pyfunc.PythonModel), and the command that
    fetches a registered model for the OpenAI-compatible server (openai_server.py); neither opens a run."""
    importers = [_name(path) for path in CODE if any(name == "mlflow" or name.startswith("mlflow.") for name in _imports(path))]
    assert [name for name in importers if not name.startswith("tracking/")] == ["serving/openai_server.py", "serving/pyfunc.py"]
    assert "tracking/opening.py" in importers  # the one place that creates a run


@pytest.mark.parametrize("module", ["pyfunc.py", "openai_server.py"])
def test_the_serving_modules_import_nothing_of_fulltune(module):
    """pyfunc.py runs alone inside `mlflow models serve`, where the trainer package is not installed; openai_server.py
    starts a server that needs only mlflow and transformers."""
    assert not {name for name in _imports(ROOT / "trainer" / "serving" / module) if name.split(".")[0] in ("trainer", "entrypoint")}


def layout_paths_built(source: str) -> list[str]:
    """Calls that join a path under the output folder: a layout name, or the folder itself (`settings.output_dir`,
    not through `Volume`; the Trainer's `args.output_dir` is the checkpoints folder, whose insides are checkpoints.py's)."""

    def under_output(arg: ast.expr) -> bool:
        text = ast.unparse(arg)
        return ("settings.output_dir" in text or text == "output_dir") and "Volume(" not in text

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.path.join", "Path"):
            if any(under_output(arg) or (isinstance(arg, ast.Constant) and arg.value in LAYOUT) for arg in node.args):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_volume_module_builds_paths_under_the_output_folder():
    assert layout_paths_built("import os\nos.path.join(settings.output_dir, 'final')\nos.path.join(state, 'status.json')") == [
        "2: os.path.join(settings.output_dir, 'final')",
        "3: os.path.join(state, 'status.json')",
    ]  # the rule sees both kinds
    owners = ("volume.py", "platforms.py")  # platforms.py names the platforms' own folders (SageMaker's /opt/ml/checkpoints)
    offenders = {path.name: found for path in CODE if path.name not in owners and (found := layout_paths_built(path.read_text()))}
    assert offenders == {}


def test_entrypoint_and_the_contract_import_no_torch():
    """entrypoint.py validates before torch is imported, so a typo exits 2 within a second: importing it, with every
    module of core/ and launch/, in a fresh interpreter loads none of the heavy libraries.  Nor does telemetry/: what
    the cluster sees of the job never waits on them."""
    import subprocess
    import sys

    modules = ["entrypoint"] + [
        f"trainer.{path.parent.name}.{path.stem}" for folder in ("core", "launch", "telemetry") for path in sorted((ROOT / "trainer" / folder).glob("*.py"))
    ]
    heavy = ["torch", "transformers", "mlflow", "trl", "datasets", "accelerate"]
    probe = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint(sorted(set({heavy!r}) & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert len(modules) > 9  # every module of both folders was imported


@pytest.mark.slow
def test_settings_are_parsed_once_by_a_launcher_without_torch_and_the_training_process_keeps_the_parents_values(tmp_path):
    out, parses = tmp_path / "volume", tmp_path / "parses"
    env = job_env(out, FT_PRESET="demo", FT_MAX_STEPS="6", FT_EVAL_STEPS="3", FT_SAVE_STEPS="6", FT_LOGGING_STEPS="3")
    launcher_modules = tmp_path / "launcher-modules.json"
    result = run_job(with_faults(env, count_parses=parses, child_env="FT_MAX_STEPS=3", record_launcher_modules=launcher_modules))  # the child's says 3
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(launcher_modules.read_text()) == []  # entrypoint.py probed the device and launched without torch (trainer/core/devices.py)
    assert len(parses.read_text().splitlines()) == 1  # entrypoint.py's parse; the training process parsed nothing
    assert "step=6/6" in result.stdout and "step=3/3" not in result.stdout
    status = json.loads((out / ".fulltune" / "status.json").read_text())
    assert status["final_model"] == str(out / "final")
    assert json.loads((out / ".fulltune" / "fingerprint.json").read_text())["FT_MAX_STEPS"] == "6"


@pytest.mark.faults("a training process started without entrypoint.py")
def test_a_training_process_started_without_entrypoint_py_exits_2_saying_how_to_start_it(tmp_path):
    import subprocess
    import sys

    env = job_env(tmp_path / "volume", FT_PRESET="demo")
    result = subprocess.run([sys.executable, "-m", "trainer"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "FULLTUNE_CONFIG is not set: start the job with entrypoint.py" in result.stderr
    assert not (tmp_path / "volume").exists()
