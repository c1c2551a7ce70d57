"""vLLM classes for MoE layers whose experts carry different schemes. Imported only inside vLLM (``vllm_plugin``).

``MixedExpertsConfig`` is vLLM's compressed-tensors config under the name ``moe-quant-mixed``: dense layers, attention
and embeddings take compressed-tensors' own paths; a fused MoE layer whose experts all share one scheme takes vLLM's
own compressed-tensors MoE method; a layer that mixes schemes takes ``MixedExpertsMethod``: one Marlin MoE weight
set per scheme group (``quant.serve.layout``), one ``fused_marlin_moe`` call per group (its own alignment,
activation and sum each, with an expert map that skips the other groups' experts; the outputs added).
``QUANT_MOE_KERNEL=mixed`` runs quant's mixed-scheme kernel instead where a layer's experts fall in at most two
symmetric W4/W8 groups (``quant.serve.mixed_moe``): the checkpoint's codes and scales stacked per group as they are
(no repacking), one alignment, one Triton GEMM launch per projection for both groups, one activation and one sum
(served right; on an H100 faster than the Marlin calls at one Qwen3-30B-A3B token only, so not the default).
``QUANT_MOE_KERNEL=nibbles`` holds every expert in one asymmetric W4 Marlin stack, each W8 expert as two rows
(``quant.serve.nibbles``), and runs one Marlin MoE call per projection (right on an H100; not faster, so opt-in).
``QUANT_MOE_ROUTING=shared`` runs one routing for all groups instead (``quant.serve.moe_routing``): the routed
tokens aligned once, each group's Marlin GEMM launch skipping the other groups' blocks, one activation and one sum
(checked on CPU against the grouped forward; not yet measured or served on a GPU, so it is not the default). With two or
more groups on a GPU and a batch of at most ``OVERLAP_MAX_TOKENS`` tokens, every group after the first runs its
launches on a second CUDA stream beside the first group's (joined before the next step, so CUDA graphs capture both):
at small batches each Marlin launch leaves most of the GPU idle, at large ones the two only contend (1 x H200, 5
Qwen3-30B-A3B layers, 128/128 tokens, separate calls: overlapped 1.29x and 1.39x the sequential groups at 1 and 16
requests, 0.95x at 256). ``QUANT_MOE_OVERLAP`` = ``0`` runs the groups one after the other on vLLM's stream at every
batch, ``1`` overlaps them at every batch. Tensor parallelism splits each
expert's intermediate dimension as vLLM does for every MoE layer; expert parallelism and EPLB are refused when the
layer is built.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import vllm._custom_ops as vllm_ops
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import apply_moe_activation
from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
    WNA16MoEBackend,
    convert_to_wna16_moe_kernel_format,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
    CompressedTensorsMoEMethod,
)
from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new
from vllm.scalar_type import scalar_types

from quant.scheme import Scheme
from quant.serve.layout import (
    KINDS,
    ExpertGroup,
    check_servable,
    expert_groups,
    place,
    rank_part,
    stacked_shapes,
)
from quant.serve.mixed_moe import (
    CONFIGS,
    MixedLayer,
    Projection,
    choose_kernel,
    layer_tables,
    mixed_moe,
    read_configs,
)
from quant.serve.moe_routing import MoeOps, group_rows, shared_routing_moe
from quant.serve.names import QUANT_METHOD
from quant.serve.nibbles import nibble_moe, nibble_stack, stack_scheme

# vLLM 0.26's Marlin MoE takes act-order tensors (g_idx, their sort indices, is_k_full) in its weight converter and
# its calls, and its converter takes the K-first stacks of ``quant.serve.layout``; 0.33's takes none of them, and
# N-first stacks (``[E, N, K / pack]``), which it makes K-first itself
MARLIN_G_IDX = "w13_g_idx" in inspect.signature(convert_to_wna16_moe_kernel_format).parameters
_QUANT_TYPES = {(4, True): scalar_types.uint4b8, (8, True): scalar_types.uint8b128, (4, False): scalar_types.uint4}


class MixedExpertsConfig(CompressedTensorsConfig):
    """compressed-tensors, plus fused MoE layers whose experts differ in bits or group size."""

    def get_name(self):
        return QUANT_METHOD

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # Marlin

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """``--quantization moe-quant-mixed`` on a plain compressed-tensors checkpoint serves it through this config
        (its MoE layers looked up by the checkpoint's own expert names)."""
        method = (hf_quant_cfg or {}).get("quant_method", "").lower().replace("compressed_tensors", "compressed-tensors")
        if user_quant == QUANT_METHOD and method in ("compressed-tensors", QUANT_METHOD):
            return QUANT_METHOD
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, RoutedExperts):
            return super().get_quant_method(layer, prefix)
        self._add_fused_moe_to_target_scheme_map()
        names = _proj_names(layer)
        schemes = [self._expert_scheme(layer, prefix, e, names) for e in range(layer.global_num_experts)]
        if len(set(schemes)) == 1 and names == VLLM_PROJ_NAMES:
            return CompressedTensorsMoEMethod.get_moe_method(self, layer, layer_name=prefix)  # vLLM's own method
        # mixed schemes, or expert names vLLM's own lookup does not try (it asks for expert 0 by its own default names)
        return MixedExpertsMethod(layer.moe_config, prefix, schemes)

    def _expert_scheme(self, layer: RoutedExperts, prefix: str, e: int, names: tuple[str, ...]) -> Scheme:
        found = []
        for n in names:
            d = self.get_scheme_dict(layer, f"{prefix}.{e}.{n}")
            w = None if d is None else d.get("weights")
            if w is None or w.type != "int" or d.get("input_activations") is not None:
                raise ValueError(f"{QUANT_METHOD}: {prefix}.{e}.{n} is not a weight-only integer scheme; the plugin "
                                 "serves layers whose every expert is W4A16 or W8A16")
            found.append(Scheme(w.num_bits, w.group_size or -1, bool(w.symmetric)))
        if len(set(found)) != 1:
            raise ValueError(f"{QUANT_METHOD}: {prefix}.{e}: gate, up and down have different schemes {found}")
        return found[0]


# vLLM's own names of an expert's gate, up and down projections: what its compressed-tensors lookup asks for, and
# what a layer that declares no checkpoint names (``ckpt_<p>_proj_name``) is stored under
VLLM_PROJ_NAMES = tuple(f"{p}_proj" for p in ("gate", "up", "down"))


def _proj_names(layer: RoutedExperts) -> tuple[str, str, str]:
    """The checkpoint's gate, up and down projection names of this layer's experts (Mixtral: w1, w3, w2)."""
    declared = (getattr(layer, f"ckpt_{p}_proj_name", None) for p in ("gate", "up", "down"))
    return tuple(d or vllm for d, vllm in zip(declared, VLLM_PROJ_NAMES, strict=True))


@dataclass
class MarlinGroup:
    group: ExpertGroup
    tensors: dict  # ("w13"|"w2", kind) -> stacked tensor (kernel layout)
    expert_map: torch.Tensor | None = None
    quant_type: object = None  # vLLM's ScalarType of the codes


OVERLAP_MAX_TOKENS = 64  # the geometric middle of the batches measured faster (16 tokens) and slower (256) overlapped
_SIDE: dict = {}  # device -> (stream, Marlin workspace): one for every layer, since layers run one after another


def _side_stream(dev: torch.device):
    """The second stream overlapped group calls run on, with its own Marlin workspace (the kernels' locks)."""
    if dev not in _SIDE:
        _SIDE[dev] = (torch.cuda.Stream(device=dev), marlin_make_workspace_new(dev, 4))
    return _SIDE[dev]


class MixedExpertsMethod(FusedMoEMethodBase):
    """A fused MoE layer as one Marlin MoE weight set per scheme group, summed over groups in the forward."""

    def __init__(self, moe, prefix: str, schemes: list[Scheme]):
        super().__init__(moe)
        par = moe.moe_parallel_config
        if par.use_ep or par.enable_eplb:
            raise NotImplementedError(f"{QUANT_METHOD}: {prefix}: experts of different schemes in one layer run "
                                      "with tensor parallelism only; drop --enable-expert-parallel / EPLB")
        self.prefix = prefix
        self.groups = [MarlinGroup(g, {}) for g in expert_groups(schemes)]
        self.row = {e: (i, r) for i, g in enumerate(self.groups) for r, e in enumerate(g.group.experts)}
        self.tp_rank, self.tp_size = par.tp_rank, par.tp_size
        self.workspace = None
        self.side = None  # the second stream of overlapped group calls (made after loading, before any capture)
        self.side_workspace = None
        mode = os.environ.get("QUANT_MOE_OVERLAP", "")
        if mode not in ("", "0", "1"):
            raise ValueError(f"{QUANT_METHOD}: QUANT_MOE_OVERLAP={mode!r}: use 0 (never), 1 (every batch) or leave it "
                             f"unset (batches of at most {OVERLAP_MAX_TOKENS} tokens)")
        self.overlap_max_tokens = {"0": 0, "1": None}.get(mode, OVERLAP_MAX_TOKENS)  # None: every batch
        routing = os.environ.get("QUANT_MOE_ROUTING", "")
        if routing not in ("", "shared", "separate"):
            raise ValueError(f"{QUANT_METHOD}: QUANT_MOE_ROUTING={routing!r}: use separate (one fused_marlin_moe "
                             "call per scheme group, the default) or shared (one alignment for every group)")
        self.routing = routing or "separate"
        if self.routing == "shared" and not SHARED_ROUTING:
            raise ValueError(f"{QUANT_METHOD}: QUANT_MOE_ROUTING=shared needs a vLLM whose Marlin MoE GEMM takes "
                             "is_ep (skips blocks of expert -1); this one does not: leave QUANT_MOE_ROUTING unset")
        self.rows = None  # [G, E]: each expert's row in each group's stack (moe_routing.group_rows)
        self.kernel = _kernel_choice(prefix, [g.group.scheme for g in self.groups])
        self.mixed = None  # the mixed kernel's weights and tables (MixedLayer), after loading
        self.nibbles = None  # the nibble stack (a MarlinGroup), its rows and its alignment's expert map, after loading
        self.tiles = _tile_table() if self.kernel == "mixed" else None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        if self.kernel == "nibbles":
            why = check_servable(stack_scheme([g.group.scheme for g in self.groups]), hidden_size,
                                 intermediate_size_per_partition)
            if why is not None:
                raise ValueError(f"{QUANT_METHOD}: {self.prefix}: QUANT_MOE_KERNEL=nibbles: {why}")
        for g in self.groups:
            why = check_servable(g.group.scheme, hidden_size, intermediate_size_per_partition)
            if why is not None:
                raise ValueError(f"{QUANT_METHOD}: {self.prefix}: {why}")
            for key, shape in stacked_shapes(g.group.scheme, len(g.group.experts), hidden_size,
                                             intermediate_size_per_partition).items():
                dtype = params_dtype if key[1] == "weight_scale" else torch.int32
                g.tensors[key] = torch.zeros(shape, dtype=dtype)
        # the checkpoint's per-expert tensors arrive by these names; each is copied into its group's stack
        asym = any(not g.group.scheme.symmetric for g in self.groups)
        for side in ("w13", "w2"):
            for kind in KINDS:
                if kind == "weight_zero_point" and not asym:
                    continue
                p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
                p.weight_loader = self._loader(side, kind)
                layer.register_parameter(f"{side}_{kind}", p)
        self.sizes = SimpleNamespace(hidden=hidden_size, intermediate=intermediate_size_per_partition)

    def _loader(self, side: str, kind: str):
        def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
            gi, row = self.row[int(expert_id)]
            g = self.groups[gi]
            if kind == "weight_shape" or (kind == "weight_zero_point" and g.group.scheme.symmetric):
                return True if return_success else None
            part = rank_part(loaded_weight, kind, shard_id, self.tp_rank, self.tp_size)
            stacked = g.tensors[(side, kind)]
            place(stacked, part.to(stacked.device), kind, shard_id, row)
            return True if return_success else None

        return load

    def process_weights_after_loading(self, layer) -> None:
        if self.kernel == "mixed":
            self.mixed = mixed_layer([g.group for g in self.groups], [g.tensors for g in self.groups],
                                     layer.global_num_experts)
            for g in self.groups:
                g.tensors = {}
        elif self.kernel == "nibbles":
            self.nibbles = nibble_layer(self.groups, self.sizes, layer.global_num_experts)
        else:
            for g in self.groups:
                to_kernel_layout(g, self.sizes.hidden, self.sizes.intermediate, layer.global_num_experts)
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)  # the routing parameters held nothing
        self.finish(layer.global_num_experts)

    def finish(self, n_experts: int) -> None:
        """The layer-wide state once every group is in the kernel layout: the routing table, the workspaces and
        the side stream (Marlin groups; the mixed kernel needs none of them, the nibble stack one workspace)."""
        if self.mixed is not None:
            return
        if self.nibbles is not None:
            self.workspace = marlin_make_workspace_new(self.nibbles[1].first.device, 4)
            return
        dev = self.groups[0].expert_map.device
        self.rows = group_rows([g.group for g in self.groups], n_experts, dev)
        self.workspace = marlin_make_workspace_new(dev, 4)
        if len(self.groups) > 1 and dev.type == "cuda" and self.overlap_max_tokens != 0:
            self.side, self.side_workspace = _side_stream(dev)

    def get_fused_moe_quant_config(self, layer):
        return None

    def _group_moe(self, g: MarlinGroup, layer, x, topk_weights, topk_ids, workspace):
        t = g.tensors
        return fused_marlin_moe(
            x, t["w13"], t["w2"], None, None, t["s13"], t["s2"], topk_weights, topk_ids,
            quant_type_id=g.quant_type.id, apply_router_weight_on_input=layer.apply_router_weight_on_input,
            global_num_experts=layer.global_num_experts, activation=layer.activation, expert_map=g.expert_map,
            w1_zeros=t["z13"], w2_zeros=t["z2"], workspace=workspace,
            **(dict(g_idx1=t["g13"], g_idx2=t["g2"], sort_indices1=t["i13"], sort_indices2=t["i2"], is_k_full=True)
               if MARLIN_G_IDX else {}))

    def _side_for(self, n_tokens: int):
        """The second stream for a batch of ``n_tokens``, or None where the groups run one after the other."""
        bound = self.overlap_max_tokens
        if self.side is None or len(self.groups) < 2 or (bound is not None and n_tokens > bound):
            return None
        return self.side

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        def act(out, inp):
            return apply_moe_activation(layer.activation, out, inp)

        if self.mixed is not None:
            return mixed_moe(x, topk_weights, topk_ids, self.mixed, align=align, act=act,
                             weight_on_input=layer.apply_router_weight_on_input, configs=self.tiles)
        if self.nibbles is not None:
            stack, rows, emap = self.nibbles

            def align_rows(ids, block_m, n_rows):  # pairs of id n_rows (a W4 expert's second slot) left out
                return moe_align_block_size(ids, block_m, n_rows + 1, emap, ignore_invalid_experts=True)

            ops = MoeOps(align=align_rows, gemm=_marlin_gemm, act=act)
            return nibble_moe(x, topk_weights, topk_ids, rows, stack, ops, intermediate=self.sizes.intermediate,
                              weight_on_input=layer.apply_router_weight_on_input, workspace=self.workspace)
        side = self._side_for(x.shape[0])
        if self.routing == "shared":
            ops = MoeOps(align=align, gemm=_marlin_gemm, act=act)
            return shared_routing_moe(x, topk_weights, topk_ids, self.groups, self.rows, ops,
                                      intermediate=self.sizes.intermediate,
                                      weight_on_input=layer.apply_router_weight_on_input,
                                      workspaces=(self.workspace, self.side_workspace), side=side)
        first, rest = self.groups[0], self.groups[1:]
        if side is None:
            out = self._group_moe(first, layer, x, topk_weights, topk_ids, self.workspace)
            for g in rest:
                out.add_(self._group_moe(g, layer, x, topk_weights, topk_ids, self.workspace))
            return out
        # the other groups on the side stream, after everything vLLM's stream has queued (x, the routing); vLLM's
        # stream waits for them before the sum, so nothing either stream frees is reused while the other reads it
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            ys = [self._group_moe(g, layer, x, topk_weights, topk_ids, self.side_workspace) for g in rest]
        out = self._group_moe(first, layer, x, topk_weights, topk_ids, self.workspace)
        main.wait_stream(side)
        for y in ys:
            out.add_(y)
        return out


def _kernel_choice(prefix: str, schemes: list[Scheme]) -> str:
    """``mixed_moe.choose_kernel`` of ``QUANT_MOE_KERNEL``, its refusal naming the layer."""
    try:
        return choose_kernel(os.environ.get("QUANT_MOE_KERNEL", ""), schemes)
    except ValueError as e:
        raise ValueError(f"{QUANT_METHOD}: {prefix}: {e}") from None


def _tile_table():
    """The mixed kernel's tile table: ``mixed_moe.CONFIGS``, or the JSON file ``QUANT_MOE_TILES`` names (one
    ``benchmarks/moe_layer.py --sweep`` wrote for this GPU), read once for every layer."""
    path = os.environ.get("QUANT_MOE_TILES", "")
    return _read_tiles(path) if path else CONFIGS


@functools.lru_cache(maxsize=4)
def _read_tiles(path: str):
    try:
        with open(path) as f:
            return read_configs(f.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{QUANT_METHOD}: QUANT_MOE_TILES={path}: {e}") from None


def mixed_layer(groups: list[ExpertGroup], tensors: list[dict], n_experts: int) -> MixedLayer:
    """The mixed kernel's layer from each group's stacked checkpoint tensors (keyed by (side, kind))."""
    schemes = tuple(g.scheme for g in groups)

    def proj(side: str) -> Projection:
        return Projection(schemes, tuple(t[(side, "weight_packed")].contiguous() for t in tensors),
                          tuple(t[(side, "weight_scale")].contiguous() for t in tensors))

    dev = tensors[0][("w13", "weight_packed")].device
    return MixedLayer(proj("w13"), proj("w2"), *layer_tables(groups, n_experts, dev))


def nibble_layer(groups: list[MarlinGroup], sizes, n_experts: int):
    """Every group's stacked tensors as one asymmetric W4 stack in Marlin's layout (``quant.serve.nibbles``): the
    stack (a ``MarlinGroup``), each expert's rows and the alignment's expert map (id ``n_rows``: no row). The groups'
    own tensors are dropped."""
    scheme, tensors, rows = nibble_stack([g.group for g in groups], [g.tensors for g in groups], n_experts)
    for g in groups:
        g.tensors = {}
    stack = MarlinGroup(ExpertGroup(scheme, tuple(range(rows.n_rows))), tensors)
    to_kernel_layout(stack, sizes.hidden, sizes.intermediate, rows.n_rows)
    dev = rows.first.device
    emap = torch.cat([torch.arange(rows.n_rows, dtype=torch.int32, device=dev),
                      torch.full((1,), -1, dtype=torch.int32, device=dev)])
    return stack, rows, emap


def to_kernel_layout(g: MarlinGroup, hidden: int, intermediate: int, n_experts: int) -> None:
    """One group's stacked compressed-tensors tensors (``g.tensors`` keyed by (side, kind)) into Marlin's layout."""
    from compressed_tensors.quantization import QuantizationArgs

    s, n, H, N = g.group.scheme, len(g.group.experts), hidden, intermediate
    dev = g.tensors[("w13", "weight_packed")].device
    holder = SimpleNamespace(intermediate_size_per_partition=N, num_groups_w13=H // s.group_size,
                             num_groups_w2=N // s.group_size)
    args = QuantizationArgs(num_bits=s.bits, type="int", symmetric=s.symmetric, strategy="group",
                            group_size=s.group_size)
    t = g.tensors
    if MARLIN_G_IDX:  # K-first stacks as they are, empty act-order tensors
        empty = torch.empty((n, 0), dtype=torch.int32, device=dev)
        out = convert_to_wna16_moe_kernel_format(
            WNA16MoEBackend.MARLIN, holder, args, None, t[("w13", "weight_packed")], t[("w2", "weight_packed")],
            t[("w13", "weight_scale")], t[("w2", "weight_scale")], w13_g_idx=empty, w2_g_idx=empty,
            w13_qzeros=t.get(("w13", "weight_zero_point")), w2_qzeros=t.get(("w2", "weight_zero_point")))
        keys = ("w13", "w2", "s13", "s2", "g13", "g2", "i13", "i2", "z13", "z2")
    else:  # the converter takes N-first stacks and makes them K-first itself
        def n_first(kind: str, side: str):
            x = t.get((side, kind))
            return None if x is None else x.transpose(1, 2)

        out = convert_to_wna16_moe_kernel_format(
            WNA16MoEBackend.MARLIN, holder, args, None, n_first("weight_packed", "w13"),
            n_first("weight_packed", "w2"), n_first("weight_scale", "w13"), n_first("weight_scale", "w2"),
            w13_qzeros=n_first("weight_zero_point", "w13"), w2_qzeros=n_first("weight_zero_point", "w2"))
        keys = ("w13", "w2", "s13", "s2", "z13", "z2")
    g.tensors = dict(zip(keys, out[:len(keys)], strict=True))
    g.expert_map = torch.tensor(g.group.expert_map(n_experts), dtype=torch.int32).to(dev)
    g.quant_type = _QUANT_TYPES[(s.bits, s.symmetric)]


def align(topk_ids: torch.Tensor, block_m: int, n_experts: int):
    """Every routed pair aligned over all experts (no expert map: each expert is some group's)."""
    return moe_align_block_size(topk_ids, block_m, n_experts)


# the shared routing needs a Marlin MoE GEMM that skips blocks of expert -1: releases whose GEMM takes ``is_ep``
# do when it is set; 0.26's has no such flag and reads expert -1's weights (an illegal address on 1 x H200)
SHARED_ROUTING = "is_ep" in inspect.signature(vllm_ops.moe_wna16_marlin_gemm).parameters
_GEMM_EP = {"is_ep": True} if SHARED_ROUTING else {}


def _marlin_gemm(a, out, g: MarlinGroup, proj: str, sorted_ids, block_rows, n_padded, topk_weights, block_m: int,
                 top_k: int, mul_weights: bool, size_m: int, size_n: int, size_k: int, workspace):
    """One group's Marlin MoE GEMM over the shared routing (``moe_routing.MoeOps.gemm``)."""
    t, n = g.tensors, proj[1:]  # "13" or "2"
    return vllm_ops.moe_wna16_marlin_gemm(
        a, out, t[proj], None, t[f"s{n}"], None, None, t[f"z{n}"], workspace=workspace, sorted_token_ids=sorted_ids,
        expert_ids=block_rows, num_tokens_past_padded=n_padded, topk_weights=topk_weights, moe_block_size=block_m,
        top_k=top_k, mul_topk_weights=mul_weights, b_q_type=g.quant_type, size_m=size_m, size_n=size_n,
        size_k=size_k, use_atomic_add=False, use_fp32_reduce=True, is_zp_float=False, **_GEMM_EP,
        **(dict(g_idx=t[f"g{n}"], perm=t[f"i{n}"], is_k_full=True) if MARLIN_G_IDX else {}))
