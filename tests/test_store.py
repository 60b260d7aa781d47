"""The embedded MLflow store on a fresh volume: a copy of an empty store made once, or MLflow's own where none can be."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import mlflow
import pytest

from trainer.core import settings as settings_table
from trainer.tracking import store


def volume_settings(volume: Path):
    return settings_table.load({"FT_PLATFORM": "none", "FT_OUTPUT_DIR": str(volume), "FT_TERMINATION_MESSAGE_PATH": ""})


def tables(db: Path) -> set[str]:
    with sqlite3.connect(db) as connection:
        return {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def assert_tracks(volume: Path, experiment_id: str) -> None:
    """The volume's store takes a run, a metric and a registered model, as the job uses it."""
    client = mlflow.MlflowClient(f"sqlite:///{volume}/mlflow/mlflow.db")
    assert client.get_experiment_by_name("fulltune").experiment_id == experiment_id
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "loss", 2.5, step=1)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [2.5]
    client.create_registered_model("catalog.schema.model")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return tmp_path / "cache"


def test_a_fresh_volumes_store_is_a_copy_of_the_template_made_once(cache, tmp_path):
    first = store.connect(volume_settings(tmp_path / "a"))
    (template,) = (cache / "fulltune").iterdir()
    assert template.name == f"mlflow-{mlflow.__version__}.db" and "experiments" in tables(template)
    assert_tracks(tmp_path / "a", first)

    with sqlite3.connect(template) as connection:  # marks the template: a store that MLflow made itself lacks this table
        connection.execute("CREATE TABLE copied_from_the_template (x INTEGER)")
    second = store.connect(volume_settings(tmp_path / "b"))
    assert "copied_from_the_template" in tables(tmp_path / "b" / "mlflow" / "mlflow.db")
    assert_tracks(tmp_path / "b", second)
    assert "copied_from_the_template" not in tables(tmp_path / "a" / "mlflow" / "mlflow.db")  # an existing store is never replaced
    assert [p.name for p in (cache / "fulltune").iterdir()] == [template.name]  # no partial file left beside it


def test_without_a_writable_cache_mlflow_makes_the_store_itself(cache, tmp_path):
    cache.write_text("a file where the cache folder would be")  # $XDG_CACHE_HOME/fulltune cannot be made
    experiment_id = store.connect(volume_settings(tmp_path / "volume"))
    assert_tracks(tmp_path / "volume", experiment_id)
    assert not list((tmp_path / "volume" / "mlflow").glob("*.partial"))
