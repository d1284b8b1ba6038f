"""Training: run config, data pipeline, trainer, checkpoints, metrics."""
