"""Per-expert schemes in one fused MoE layer, laid out for vLLM's Marlin MoE kernel. Pure tensor code (no vLLM).

Legend: ``E`` experts of the layer, ``E_g`` experts of one scheme group, ``H`` hidden, ``N`` expert intermediate on
this tensor-parallel rank, ``pf = 32 / bits`` codes per int32 word, ``G`` groups along a weight's input.

A checkpoint stores each expert projection as compressed-tensors ``pack-quantized`` tensors: ``weight_packed [out,
in / pf]`` (int32), ``weight_scale [out, in / group]``, ``weight_zero_point [out / pf, in / group]`` (asymmetric
schemes only, packed along the output) and ``weight_shape [2]``. A layer's experts are split into scheme groups;
each group's experts are stacked in the kernel's input layout, which is the transpose of each 2-D tensor:

- ``w13`` (gate then up): codes ``[E_g, H / pf, 2N]``, scales ``[E_g, H / group, 2N]``, zero points
  ``[E_g, H / group, 2N / pf]``;
- ``w2`` (down): codes ``[E_g, N / pf, H]``, scales ``[E_g, N / group, H]``, zero points ``[E_g, N / group, H / pf]``.

The forward is one fused-MoE call per group over every routed token, with an expert map sending the group's experts
to ``0 .. E_g - 1`` and every other expert to ``-1`` (its slots are skipped and add nothing); the groups' outputs are
summed. ``grouped_moe_reference`` is that computation in plain torch on dequantized weights, the reference the
kernel path is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.scheme import Scheme

KINDS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
SHARDS = {"w1": "gate", "w3": "up", "w2": "down"}


@dataclass(frozen=True)
class ExpertGroup:
    """The experts of one layer that share a scheme, in expert order; ``local`` maps a layer expert to its row."""

    scheme: Scheme
    experts: tuple[int, ...]

    def expert_map(self, n_experts: int) -> list[int]:
        """``[E]``: the row of each expert of this group, ``-1`` for every other expert."""
        out = [-1] * n_experts
        for row, e in enumerate(self.experts):
            out[e] = row
        return out


def expert_groups(schemes: list[Scheme]) -> list[ExpertGroup]:
    """``schemes[e]`` -> the layer's scheme groups, highest bits first (the order is fixed by the schemes alone)."""
    by: dict[Scheme, list[int]] = {}
    for e, s in enumerate(schemes):
        by.setdefault(s, []).append(e)
    return [ExpertGroup(s, tuple(by[s])) for s in sorted(by, key=lambda s: (-s.bits, s.group_size, not s.symmetric))]


def check_servable(scheme: Scheme, hidden: int, intermediate: int) -> str | None:
    """Why vLLM's Marlin MoE kernel cannot run ``scheme`` at these sizes (``intermediate`` per rank), or None."""
    if scheme.bits not in (4, 8):
        return f"{scheme.bits}-bit experts (Marlin MoE runs 4 and 8 bits)"
    if not scheme.symmetric and scheme.bits == 8:
        return "8-bit experts with zero points (Marlin MoE runs 8 bits symmetric only)"
    if scheme.group_size not in (32, 64, 128):
        return f"group size {scheme.group_size} (Marlin MoE runs 32, 64 and 128)"
    if hidden % 128 or hidden % scheme.group_size:
        return f"hidden size {hidden} (needs a multiple of 128 and of the group size {scheme.group_size})"
    if intermediate % max(64, scheme.group_size):
        return f"expert intermediate size {intermediate} per rank (needs a multiple of {max(64, scheme.group_size)})"
    if not scheme.symmetric and intermediate % scheme.pack_factor:
        return f"expert intermediate size {intermediate} per rank (zero points need a multiple of {scheme.pack_factor})"
    return None


def rank_part(loaded: torch.Tensor, kind: str, shard: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of one expert projection's checkpoint tensor (``shard`` ``w1``/``w3``: gate/up are split
    along their output, ``w2``: down along its input), still in checkpoint layout."""
    assert kind in KINDS and shard in SHARDS, (kind, shard)
    if kind == "weight_shape" or tp_size == 1:
        return loaded
    dim = 0 if shard in ("w1", "w3") else 1
    size = loaded.shape[dim]
    assert size % tp_size == 0, (kind, shard, tuple(loaded.shape), tp_size)
    part = size // tp_size
    return loaded.narrow(dim, tp_rank * part, part)


def kernel_slot(stacked: torch.Tensor, kind: str, shard: str, row: int) -> torch.Tensor:
    """The view of a group's stacked tensor that one expert projection's part fills, in the kernel layout
    (``[in-ish, out-ish]``): gate fills the first half of ``w13``'s last dimension, up the second half."""
    if shard == "w2":
        return stacked[row]
    half = stacked.shape[2] // 2
    return stacked[row, :, :half] if shard == "w1" else stacked[row, :, half:]


def place(stacked: torch.Tensor, part: torch.Tensor, kind: str, shard: str, row: int) -> None:
    """Copy one expert projection's part (checkpoint layout) into its slot of a stacked group tensor."""
    slot = kernel_slot(stacked, kind, shard, row)
    src = part.t()
    if tuple(slot.shape) != tuple(src.shape):
        raise ValueError(f"{kind} of {SHARDS[shard]}: checkpoint part {tuple(part.shape)} does not fit its slot "
                         f"{tuple(slot.shape)} (transposed); the checkpoint's scheme or sizes differ from config.json")
    slot.copy_(src.to(slot.dtype))


def stacked_shapes(scheme: Scheme, n_experts: int, hidden: int, intermediate: int) -> dict[tuple[str, str], tuple]:
    """(``w13``/``w2``, kind) -> the shape of a group's stacked tensor in the kernel layout."""
    pf, g, H, N, E = scheme.pack_factor, scheme.group_size, hidden, intermediate, n_experts
    shapes = {("w13", "weight_packed"): (E, H // pf, 2 * N), ("w2", "weight_packed"): (E, N // pf, H),
              ("w13", "weight_scale"): (E, H // g, 2 * N), ("w2", "weight_scale"): (E, N // g, H)}
    if not scheme.symmetric:
        shapes |= {("w13", "weight_zero_point"): (E, H // g, 2 * N // pf), ("w2", "weight_zero_point"): (E, N // g, H // pf)}
    return shapes


def grouped_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, groups: list[ExpertGroup],
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The plugin's forward on dense weights: a sum over scheme groups, each over every routed token, with the other
    groups' slots skipped. ``x [T, H]``, ``w13 [E, 2N, H]`` (gate then up), ``w2 [E, H, N]``, ``topk_* [T, k]``."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    out = torch.zeros_like(x, dtype=torch.float32)
    for g in groups:
        emap = torch.tensor(g.expert_map(E), dtype=torch.long)
        local = emap[topk_ids]  # [T, k]: the row in this group, -1 for the other groups' experts
        rows = torch.tensor(g.experts, dtype=torch.long)
        for slot in range(k):
            hit = local[:, slot] >= 0
            if not bool(hit.any()):
                continue
            e = rows[local[hit, slot]]
            gu = torch.einsum("th,tnh->tn", x[hit].float(), w13[e].float())
            gate, up = gu.chunk(2, dim=1)
            y = torch.einsum("tn,thn->th", torch.nn.functional.silu(gate) * up, w2[e].float())
            out[hit] += topk_weights[hit, slot, None].float() * y
    return out.to(x.dtype)
