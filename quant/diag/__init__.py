"""Diagnostics for GPU runs: live tensor bytes and host syncs by source line."""
