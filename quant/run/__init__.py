"""The pipeline: stage order, stage bodies."""
