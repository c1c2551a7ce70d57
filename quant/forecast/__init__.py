"""Forecasts before a run: memory, disk and time per stage."""
