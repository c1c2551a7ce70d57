"""Names a per-expert checkpoint and the vLLM plugin agree on (no vLLM import here)."""

# config.json ``quantization_config.quant_method`` of a compressed-tensors checkpoint in which one fused MoE layer's
# experts carry different schemes: stock vLLM refuses it ("Unknown quantization method"), the plugin serves it
QUANT_METHOD = "moe-quant-mixed"
# the plugin's entry point in the ``vllm.general_plugins`` group (``VLLM_PLUGINS`` names it)
PLUGIN_NAME = "moe_quant"
PLUGIN_TARGET = "quant.serve.vllm_plugin:register"
# the quant_method values of compressed-tensors checkpoints quant writes (what its own readers accept)
COMPRESSED_TENSORS_METHODS = ("compressed-tensors", QUANT_METHOD)
