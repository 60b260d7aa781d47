"""The saved model's own serving code (copied into the MLflow model; it imports nothing of fulltune)."""
