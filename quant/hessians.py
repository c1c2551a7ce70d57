"""Second-moment statistics for GPTQ, accumulated with hooks while calibration batches run through a layer.

``H = mean over tokens of x xᵀ`` (fp32) per input: one per nn.Linear, and per expert for the fused experts —
``gate_up [E, D, D]`` (gate and up share an input, so one Hessian serves both) and ``down [E, I, I]``.
Expert statistics are batched: routed tokens are grouped into padded ``[E, C, ·]`` blocks and reduced with
``bmm``. Options: gate-weighted (each routed token weighted by its routing weight, MoEQuant's AGQ) and
all-experts (every token through every expert; routed outputs are unaffected because only the statistics
see the extra tokens).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from quant.models.layers import ExpertsView
from quant.routing import chunk_budget, expert_intermediate, group_tokens, token_chunks


@contextlib.contextmanager
def exact_tf32(enabled: bool):
    """TF32 tensor-core matmuls for statistics of bf16/fp16 activations: their 8/11-bit significands convert to
    TF32 exactly and products accumulate in fp32, so the Hessian equals the fp32 one up to summation order."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled or prev
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _low_precision(x: torch.Tensor) -> bool:
    return x.dtype in (torch.bfloat16, torch.float16)


class LinearStats:
    """Running ``Σ x xᵀ`` and token count of one nn.Linear's input."""

    def __init__(self, module: nn.Linear):
        n = module.in_features
        self.sum = torch.zeros(n, n, dtype=torch.float32, device=module.weight.device)
        self.abs_sum = torch.zeros(n, dtype=torch.float32, device=module.weight.device)
        self.n = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, _m, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        with exact_tf32(_low_precision(x)):
            xf = x.float()
            self.sum.addmm_(xf.T, xf)
        self.abs_sum += xf.abs().sum(dim=0)
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.sum / max(self.n, 1)

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.n, 1)


class ExpertStats:
    """Per-expert Hessians of the fused experts' two inputs, from the experts module's pre-hook.

    Only experts ``first .. first + count - 1`` are accumulated, so a layer whose Hessians do not fit in memory
    at once (DeepSeek-V3: 256 × 7168² fp32 = 52 GB) is handled in chunks, one calibration pass per chunk.
    """

    def __init__(self, view: ExpertsView, gate_weighted: bool, all_experts: bool, first: int = 0,
                 count: int | None = None, need_down: bool = True):
        count = view.n_experts - first if count is None else count
        E, D, I = count, view.gate_up.shape[2], view.intermediate
        dev = view.gate_up.device
        self.view, self.gate_weighted, self.all_experts, self.need_down = view, gate_weighted, all_experts, need_down
        self.first, self.count = first, count
        self.sum_gu = torch.zeros(E, D, D, dtype=torch.float32, device=dev)
        self.sum_down = torch.zeros(E, I, I, dtype=torch.float32, device=dev) if need_down else None
        self.abs_gu = torch.zeros(E, D, dtype=torch.float32, device=dev)
        self.abs_down = torch.zeros(E, I, dtype=torch.float32, device=dev)
        self.weight_sum = torch.zeros(E, dtype=torch.float64, device=dev)
        self.counts = torch.zeros(E, dtype=torch.long, device=dev)
        self.handle = view.module.register_forward_pre_hook(self._hook)

    def _hook(self, _m, args) -> None:
        x, idx, w = args[0], args[1], args[2]
        E = self.view.n_experts
        self.counts += torch.bincount(idx.reshape(-1), minlength=E)[self.first : self.first + self.count]
        if self.all_experts:
            idx = torch.arange(self.first, self.first + self.count, device=idx.device).expand(x.shape[0], self.count)
            w = torch.ones(idx.shape, dtype=x.dtype, device=x.device)
        k_eff = max(1, idx.shape[1] * self.count // E) if not self.all_experts else idx.shape[1]
        step = token_chunks(x.shape[0], k_eff, self.count, max(self.view.gate_up.shape[1:]),
                            chunk_budget(x.device))
        with exact_tf32(_low_precision(x) and not self.gate_weighted):
            for t0 in range(0, x.shape[0], step):
                self._accumulate(x[t0 : t0 + step], idx[t0 : t0 + step], w[t0 : t0 + step])

    def _accumulate(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
        g = group_tokens(idx, w, self.count, self.first)
        xg = g.gather(x)
        row_w = g.weight.float() if self.gate_weighted else g.mask.float()
        self.weight_sum += row_w.sum(dim=1).double()
        sqrt_w = row_w.sqrt().unsqueeze(-1)
        xs = xg.float() * sqrt_w
        self.sum_gu.baddbmm_(xs.transpose(1, 2), xs)
        self.abs_gu += xs.abs().sum(dim=1)
        if self.need_down:
            gate_up = self.view.gate_up[self.first : self.first + self.count]
            a = expert_intermediate(xg, gate_up, self.view.act).float() * sqrt_w
            self.sum_down.baddbmm_(a.transpose(1, 2), a)
            self.abs_down += a.abs().sum(dim=1)

    def mean_abs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """mean |x| per input channel, per expert: gate/up input ``[E, D]``, down input ``[E, I]``."""
        denom = self.weight_sum.clamp_min(1e-12).float()[:, None]
        return self.abs_gu / denom, self.abs_down / denom

    def hessians(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        denom = self.weight_sum.clamp_min(1e-12).float().view(-1, 1, 1)
        return self.sum_gu / denom, None if self.sum_down is None else self.sum_down / denom

    def remove(self) -> None:
        self.handle.remove()
