"""Serving quant's checkpoints: the vLLM plugin for MoE layers whose experts carry different schemes.

Installing quant beside vLLM (``pip install --no-deps moe-quant``; there is no ``serve`` extra) registers
``quant.serve.vllm_plugin:register`` in vLLM's ``vllm.general_plugins`` entry-point group; vLLM calls it in every
process it starts. Only ``vllm_mixed`` imports vLLM.
"""
