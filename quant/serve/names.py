"""Names a per-expert checkpoint and the vLLM plugin agree on (no vLLM import here)."""

# config.json ``quantization_config.quant_method`` of a compressed-tensors checkpoint in which one fused MoE layer's
# experts carry different schemes: stock vLLM refuses it ("Unknown quantization method"), the plugin serves it
QUANT_METHOD = "moe-quant-mixed"
# the plugin's entry point in the ``vllm.general_plugins`` group (``VLLM_PLUGINS`` names it)
PLUGIN_NAME = "moe_quant"
PLUGIN_TARGET = "quant.serve.vllm_plugin:register"
# the quant_method values of compressed-tensors checkpoints quant writes (what its own readers accept)
COMPRESSED_TENSORS_METHODS = ("compressed-tensors", QUANT_METHOD)
# the vLLM releases the plugin serves: it reaches into vLLM's fused-MoE internals, which change from release to
# release, so it serves these minor versions and refuses others by name. 0.26.0 was served (tests/serve on an H200);
# 0.33.0 was checked from its source only (benchmarks/vllm_api.py: every vLLM symbol the plugin imports, calls or
# overrides, with its signature, tests/serve/data/vllm-api-0.33.0.json), not served: it needs torch 2.14
TESTED_VLLM = ("0.26.0",)
CHECKED_VLLM = ("0.33.0",)
SUPPORTED_VLLM_MINORS = ((0, 26), (0, 33))
VLLM_INSTALL = "pip install vllm==0.26.0"


def vllm_version_problem(version: str) -> str | None:
    """Why the plugin does not serve with vLLM ``version`` (``vllm.__version__``), or None when it does."""
    import re

    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m[1]), int(m[2])) in SUPPORTED_VLLM_MINORS:
        return None
    known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM_MINORS)
    return (f"quant's vLLM plugin ({QUANT_METHOD}) serves vLLM {known} (served on {', '.join(TESTED_VLLM)}; "
            f"{', '.join(CHECKED_VLLM)} checked from its source), not vLLM {version}: {VLLM_INSTALL}, or serve a "
            "per-layer checkpoint (recipes/mixed_vllm.yaml) with stock vLLM")
