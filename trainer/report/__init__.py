"""The run report: one self-contained HTML page on the volume and in the MLflow run, refreshed at every evaluation."""
