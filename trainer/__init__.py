"""rlgate's trainer: Celery tasks, batch assembly, advantages, losses, engine, checkpoints."""
