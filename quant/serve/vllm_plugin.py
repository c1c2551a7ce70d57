"""vLLM's entry point into quant (``vllm.general_plugins``): registers the ``moe-quant-mixed`` quantization method."""

from __future__ import annotations

from pathlib import Path

from quant.serve.names import PLUGIN_NAME, PLUGIN_TARGET, QUANT_METHOD, vllm_version_problem

_registered = False


def register() -> None:
    """Make vLLM serve ``moe-quant-mixed`` checkpoints. vLLM calls this once in each of its processes. On a vLLM
    release the plugin does not support (``names.vllm_version_problem``) the name is registered to a config that
    refuses every checkpoint with that one line, rather than to code written against other vLLM internals."""
    global _registered
    if _registered:
        return
    import vllm
    from vllm.model_executor.layers.quantization import register_quantization_config

    problem = vllm_version_problem(vllm.__version__)
    if problem is None:
        from quant.serve.vllm_mixed import MixedExpertsConfig

        register_quantization_config(QUANT_METHOD)(MixedExpertsConfig)
    else:
        register_quantization_config(QUANT_METHOD)(_refusing_config(problem))
    _registered = True


def _refusing_config(problem: str):
    """A vLLM quantization config class whose checkpoints are refused with ``problem`` when vLLM reads them."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class UnsupportedVLLM(QuantizationConfig):
        """Every question vLLM asks of a checkpoint's config before building layers is answered with ``problem``."""

        @classmethod
        def get_name(cls):
            return QUANT_METHOD

        @classmethod
        def get_config_filenames(cls):
            return []

        @classmethod
        def get_min_capability(cls):
            return 0

        @classmethod
        def get_supported_act_dtypes(cls):
            raise ValueError(problem)

        @classmethod
        def from_config(cls, config):
            raise ValueError(problem)

        def get_quant_method(self, layer, prefix):
            raise ValueError(problem)

    return UnsupportedVLLM


def checkout_entry_point(folder: Path) -> Path:
    """A folder that, on vLLM's ``PYTHONPATH`` beside a quant checkout, registers the plugin as ``pip install``
    does (a dist-info holding the ``vllm.general_plugins`` entry point pyproject.toml declares): for serving from a
    checkout that is not installed, e.g. on a GPU node without network. Returns ``folder``."""
    from quant import version

    info = Path(folder) / "moe_quant_serve-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: moe-quant-serve\nVersion: {version()}\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")
    return Path(folder)
