"""What people look at: the MLflow run and its queue, the progress line, sample answers, the run report."""
