"""vLLM classes for MoE layers whose experts carry different schemes. Imported only inside vLLM (``vllm_plugin``).

``MixedExpertsConfig`` is vLLM's compressed-tensors config under the name ``moe-quant-mixed``: dense layers, attention
and embeddings take compressed-tensors' own paths; a fused MoE layer whose experts all share one scheme takes vLLM's
own compressed-tensors MoE method; a layer that mixes schemes takes ``MixedExpertsMethod``: one Marlin MoE weight
set per scheme group (``quant.serve.layout``), one ``fused_marlin_moe`` call per group with an expert map that
skips the other groups' experts, the outputs summed. With two or more groups on a GPU and a batch of at most
``OVERLAP_MAX_TOKENS`` tokens, every group after the first runs on a second CUDA stream beside the first group's call
(joined before the sum, so CUDA graphs capture both): at small batches each Marlin call leaves most of the GPU idle,
at large ones the two calls only contend (1 x H200, 5 Qwen3-30B-A3B layers, 128/128 tokens: overlapped 1.29x and
1.39x the sequential groups at 1 and 16 requests, 0.95x at 256). ``QUANT_MOE_OVERLAP`` = ``0`` runs the groups one
after the other on vLLM's stream at every batch, ``1`` overlaps them at every batch. Tensor parallelism splits each
expert's intermediate dimension as vLLM does for every MoE layer; expert parallelism and EPLB are refused when the
layer is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
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

from quant.serve.layout import (
    KINDS,
    ExpertGroup,
    Scheme,
    check_servable,
    expert_groups,
    place,
    rank_part,
    stacked_shapes,
)
from quant.serve.names import QUANT_METHOD

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
class _Group:
    group: ExpertGroup
    tensors: dict  # ("w13"|"w2", kind) -> stacked tensor (kernel layout)
    expert_map: torch.Tensor | None = None
    quant_type_id: int = 0


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
        self.groups = [_Group(g, {}) for g in expert_groups(schemes)]
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

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
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
        N, H = self.sizes.intermediate, self.sizes.hidden
        for g in self.groups:
            s = g.group.scheme
            n = len(g.group.experts)
            dev = g.tensors[("w13", "weight_packed")].device
            holder = SimpleNamespace(intermediate_size_per_partition=N, num_groups_w13=H // s.group_size,
                                     num_groups_w2=N // s.group_size)
            from compressed_tensors.quantization import QuantizationArgs

            args = QuantizationArgs(num_bits=s.bits, type="int", symmetric=s.symmetric, strategy="group",
                                    group_size=s.group_size)
            empty = torch.empty((n, 0), dtype=torch.int32, device=dev)
            out = convert_to_wna16_moe_kernel_format(
                WNA16MoEBackend.MARLIN, holder, args, None, g.tensors[("w13", "weight_packed")],
                g.tensors[("w2", "weight_packed")], g.tensors[("w13", "weight_scale")],
                g.tensors[("w2", "weight_scale")], w13_g_idx=empty, w2_g_idx=empty,
                w13_qzeros=g.tensors.get(("w13", "weight_zero_point")), w2_qzeros=g.tensors.get(("w2", "weight_zero_point")))
            keys = ("w13", "w2", "s13", "s2", "g13", "g2", "i13", "i2", "z13", "z2")
            g.tensors = dict(zip(keys, out[:10], strict=True))
            g.expert_map = torch.tensor(g.group.expert_map(layer.global_num_experts), dtype=torch.int32).to(dev)
            g.quant_type_id = _QUANT_TYPES[(s.bits, s.symmetric)].id
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]:
            delattr(layer, name)  # the routing parameters held nothing
        dev = self.groups[0].expert_map.device
        self.workspace = marlin_make_workspace_new(dev, 4)
        if len(self.groups) > 1 and dev.type == "cuda" and self.overlap_max_tokens != 0:
            self.side, self.side_workspace = _side_stream(dev)

    def get_fused_moe_quant_config(self, layer):
        return None

    def _group_moe(self, g: _Group, layer, x, topk_weights, topk_ids, workspace):
        t = g.tensors
        return fused_marlin_moe(
            x, t["w13"], t["w2"], None, None, t["s13"], t["s2"], topk_weights, topk_ids,
            quant_type_id=g.quant_type_id, apply_router_weight_on_input=layer.apply_router_weight_on_input,
            global_num_experts=layer.global_num_experts, activation=layer.activation, expert_map=g.expert_map,
            g_idx1=t["g13"], g_idx2=t["g2"], sort_indices1=t["i13"], sort_indices2=t["i2"],
            w1_zeros=t["z13"], w2_zeros=t["z2"], workspace=workspace, is_k_full=True)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        first, rest = self.groups[0], self.groups[1:]
        bound = self.overlap_max_tokens
        if self.side is None or not rest or (bound is not None and x.shape[0] > bound):
            out = self._group_moe(first, layer, x, topk_weights, topk_ids, self.workspace)
            for g in rest:
                out.add_(self._group_moe(g, layer, x, topk_weights, topk_ids, self.workspace))
            return out
        # the other groups on the side stream, after everything vLLM's stream has queued (x, the routing); vLLM's
        # stream waits for them before the sum, so nothing either stream frees is reused while the other reads it
        main = torch.cuda.current_stream(x.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            ys = [self._group_moe(g, layer, x, topk_weights, topk_ids, self.side_workspace) for g in rest]
        out = self._group_moe(first, layer, x, topk_weights, topk_ids, self.workspace)
        main.wait_stream(self.side)
        for y in ys:
            out.add_(y)
        return out
