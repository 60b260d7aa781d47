"""The MLflow client: the job's one run and its queue, the store, the server's answers, the registry, the saved MLflow model."""
