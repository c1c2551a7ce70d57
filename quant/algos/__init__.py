"""Pure quantization math, batched over experts: grids, RTN, GPTQ, AWQ. No modules, hooks, devices or I/O."""

import importlib


def triton_runs(t, module: str) -> bool:
    """Whether the Triton kernels of ``module`` (``quant.algos.gptq_triton``, ``quant.algos.awq_triton``) can run on
    tensor ``t``: it is on a GPU and the module imports (Triton installed); otherwise callers use their torch path,
    which computes the same thing."""
    if not t.is_cuda:
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
