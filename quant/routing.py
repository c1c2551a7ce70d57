"""Routed tokens grouped by expert, and per-expert matmuls over them without a Python loop over experts.

Legend: ``T`` tokens, ``k`` experts per token, ``E`` experts, ``D`` hidden, ``I`` expert intermediate,
``C`` the largest per-expert token count in a chunk (padded groups are ``[E, C, ·]`` with zero rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Groups:
    """Assignments of ``T`` tokens to ``E`` experts, as padded index tensors.

    ``token [E, C]`` token index per slot (0 where padded), ``weight [E, C]`` routing weight applied to that
    assignment (0 where padded), ``mask [E, C]`` True for real slots, ``counts [E]``.
    """

    token: torch.Tensor
    weight: torch.Tensor
    mask: torch.Tensor
    counts: torch.Tensor

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` -> ``[E, C, D]`` with zero rows in the padding."""
        return x[self.token] * self.mask.unsqueeze(-1).to(x.dtype)


def group_tokens(top_idx: torch.Tensor, top_w: torch.Tensor, n_experts: int, first_expert: int = 0) -> Groups:
    """``top_idx, top_w [T, k]`` -> padded groups of experts ``first_expert .. first_expert + n_experts - 1``.

    Assignments to other experts are dropped (statistics for a chunk of experts). Tokens keep ascending order
    within an expert.
    """
    T, k = top_idx.shape
    flat_e = top_idx.reshape(-1) - first_expert
    keep = (flat_e >= 0) & (flat_e < n_experts)
    token = torch.arange(T * k, device=top_idx.device)[keep] // k
    return group_assignments(token, flat_e[keep], top_w.reshape(-1)[keep], n_experts)


def group_assignments(token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor, n_experts: int) -> Groups:
    """Flat assignments (``token, expert, weight [A]``) -> padded ``[E, C]`` groups."""
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_experts)
    C = max(int(counts.max().item()) if counts.numel() else 0, 1)
    starts = torch.cumsum(counts, 0) - counts
    sorted_e = expert[order]
    slot = torch.arange(order.numel(), device=expert.device) - starts[sorted_e]
    dev = expert.device
    g_token = torch.zeros(n_experts, C, dtype=torch.long, device=dev)
    g_weight = torch.zeros(n_experts, C, dtype=weight.dtype, device=dev)
    mask = torch.zeros(n_experts, C, dtype=torch.bool, device=dev)
    g_token[sorted_e, slot] = token[order]
    g_weight[sorted_e, slot] = weight[order]
    mask[sorted_e, slot] = True
    return Groups(g_token, g_weight, mask, counts)


def expert_intermediate(xg: torch.Tensor, gate_up: torch.Tensor, act) -> torch.Tensor:
    """``xg [E, C, D]``, ``gate_up [E, 2I, D]`` -> ``act(gate) * up`` ``[E, C, I]`` (the down-proj input)."""
    h = torch.bmm(xg, gate_up.transpose(1, 2).to(xg.dtype))
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def expert_output(a: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``a [E, C, I]``, ``down [E, D, I]`` -> ``[E, C, D]`` (before routing weights)."""
    return torch.bmm(a, down.transpose(1, 2).to(a.dtype))


def chunk_budget(device: torch.device) -> int:
    """Elements per padded per-expert buffer: ~1 GB fp32 on a GPU, small on a CPU."""
    return 1 << (28 if device.type == "cuda" else 24)


def token_chunks(n_tokens: int, k: int, n_experts: int, width: int, budget_elems: int = 1 << 27) -> int:
    """Tokens per chunk so that padded ``[E, C, width]`` buffers stay near ``budget_elems`` (C ~ 4x mean load)."""
    per_token = max(1, 4 * k * width)
    return max(1, min(n_tokens, budget_elems // per_token))
