"""Bytes on disk and in host memory: safetensors reads, page-locked staging buffers, digests, the run directory."""
