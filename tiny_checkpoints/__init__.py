"""The tiny random checkpoints' deterministic generators (test fixtures; not installed with modelzoo)."""
