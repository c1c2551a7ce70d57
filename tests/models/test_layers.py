"""Layer-by-layer execution equals the full transformers model, for every builtin family."""

import pytest
import torch

from quant.errors import ModelError
from quant.layerwise import Layerwise
from quant.models import BUILTINS, resolve_model
from quant.models.families import FAMILIES
from quant.parallel.world import World


@pytest.mark.parametrize("name", list(BUILTINS))
def test_layerwise_equals_full_model(name):
    from transformers import AutoModelForCausalLM

    src = resolve_model(f"builtin:{name}")
    tokens = torch.randint(0, 1000, (3, 20), generator=torch.Generator().manual_seed(1))
    logits = Layerwise(src, "float32", "cpu", batch_size=2, world=World()).logits(tokens)
    full = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
    with torch.no_grad():
        ref = full(tokens).logits
    assert torch.allclose(logits, ref, atol=1e-4), (logits - ref).abs().max()


def test_builtins_are_deterministic(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from quant.models.builtin import builtin_path

    a = load_file(str(builtin_path("mixtral-tiny") / "model.safetensors"))
    monkeypatch.setenv("QUANT_CACHE", str(tmp_path))
    b = load_file(str(builtin_path("mixtral-tiny") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_canonical_names_cover_every_family():
    cases = {
        "qwen3_moe": ("model.layers.2.mlp.experts.5.up_proj.weight", "layers.2.experts.5.up"),
        "mixtral": ("model.layers.1.block_sparse_moe.experts.3.w2.weight", "layers.1.experts.3.down"),
        "deepseek_v3": ("model.layers.4.mlp.shared_experts.gate_proj.weight", "layers.4.shared.gate"),
        "olmoe": ("model.layers.0.self_attn.o_proj.weight", "layers.0.attn.o"),
        "qwen2_moe": ("model.layers.0.mlp.shared_expert.down_proj.weight", "layers.0.shared.down"),
    }
    for fam, (disk, canonical) in cases.items():
        assert FAMILIES[fam].canonical(disk) == canonical
    assert FAMILIES["deepseek_v3"].canonical("model.layers.1.self_attn.kv_a_layernorm.weight") is None
    assert FAMILIES["mixtral"].canonical("model.layers.1.block_sparse_moe.gate.weight") == "layers.1.router"


def test_module_inventory_shapes():
    src = resolve_model("builtin:deepseek-v3-tiny")
    m = src.modules
    assert m["layers.1.experts.3.gate"].out_features == 32 and m["layers.1.experts.3.gate"].in_features == 64
    assert m["layers.0.mlp.down"].kind == "dense_mlp" and "layers.0.experts.0.up" not in m
    assert src.moe_layers() == [1, 2, 3] and src.n_experts(1) == 16 and src.top_k == 4


def test_unsupported_family(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "jamba", "num_experts": 4}))
    with pytest.raises(ModelError, match="an MoE family quant does not support"):
        resolve_model(str(tmp_path))


def test_reference_moe_ships_and_has_language_ability():
    """The shipped trained MoE unpacks (hash-checked), loads through transformers and predicts held-out text
    far better than chance (vocabulary 8192)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model("builtin:reference-moe")
    assert src.family.name == "qwen3_moe" and src.n_experts(0) == 32 and src.top_k == 4
    tok = AutoTokenizer.from_pretrained(src.path)
    model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
    text = open("calibration/data/heldout-python-code.txt").read()[:4000]
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert torch.exp(torch.tensor(loss)) < 60  # measured ~20 on this file; uniform would be 8192


def test_decoder_layers_without_transformers5_rotary_are_refused():
    from torch import nn

    from quant.models.layers import LayerRunner

    model = nn.Module()
    model.model = nn.Module()  # remote code computing rotary inside its attention (transformers 4.x style)
    with pytest.raises(ModelError, match="no model.rotary_emb"):
        LayerRunner(model, "cpu", torch.float32)


@pytest.mark.parametrize("name", ["builtin:qwen3-moe-tiny", "builtin:deepseek-v3-tiny", "builtin:mixtral-tiny"])
def test_stacking_a_layer_s_experts_holds_them_once(name):
    """The experts go straight into their slices of the stacked tensors: while a layer's state is built, no more than
    the stacked experts (plus the few kept tensors) are allocated; per-expert concatenations and their stack held
    ~2x (and on a GPU the per-expert uploads a third copy: a DeepSeek-V3 layer's load peaked at 54.5 GB for 22.5 GB
    of experts). The stacked tensors equal concatenating and stacking the experts read from disk."""
    from quant.diag.memtrace import LiveBytes
    from quant.models.layers import _layer_state, read_layer_tensors

    src = resolve_model(name)
    idx = max(src.moe_layers())
    raw = read_layer_tensors(src, idx)
    with LiveBytes() as trace:
        state, (gate_up, down) = _layer_state(src, idx, "cpu", "mlp", dict(raw))
    stacked = gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
    assert stacked <= trace.peak.bytes <= 1.05 * stacked, (trace.peak.bytes, stacked)
    fam = src.family
    e_key = lambda e, proj: f"model.layers.{idx}.{fam.disk_moe}.experts.{e}.{fam.expert_proj[proj]}.weight"  # noqa: E731
    E = gate_up.shape[0]
    assert torch.equal(gate_up, torch.stack([torch.cat([raw[e_key(e, "gate")], raw[e_key(e, "up")]]) for e in range(E)]))
    assert torch.equal(down, torch.stack([raw[e_key(e, "down")] for e in range(E)]))


def test_experts_of_different_shapes_are_one_clear_error():
    from quant.models.layers import _layer_state, read_layer_tensors

    src = resolve_model("builtin:qwen3-moe-tiny")
    idx = max(src.moe_layers())
    raw = read_layer_tensors(src, idx)
    key = next(k for k in raw if ".experts.1." in k and k.endswith(f"{src.family.expert_proj['up']}.weight"))
    raw[key] = raw[key][:-1]
    with pytest.raises(ModelError, match=f"layer {idx}'s experts differ in shape"):
        _layer_state(src, idx, "cpu", "mlp", raw)


def test_experts_are_stacked_in_the_compute_dtype_as_they_are_copied():
    """Cast on the way into the stacked tensors: no stacked copy in the stored dtype first."""
    from quant.diag.memtrace import LiveBytes
    from quant.models.layers import _layer_state, read_layer_tensors

    src = resolve_model("builtin:qwen3-moe-tiny")
    idx = max(src.moe_layers())
    raw = read_layer_tensors(src, idx)
    _, (ref_gate_up, ref_down) = _layer_state(src, idx, "cpu", "mlp", dict(raw))
    with LiveBytes() as trace:
        _, (gate_up, down) = _layer_state(src, idx, "cpu", "mlp", dict(raw), torch.float16)
    assert gate_up.dtype == down.dtype == torch.float16
    assert torch.equal(gate_up, ref_gate_up.to(torch.float16)) and torch.equal(down, ref_down.to(torch.float16))
    assert trace.peak.bytes <= 1.05 * (gate_up.numel() + down.numel()) * 2


def test_experts_received_into_their_slots_are_not_copied_and_misplaced_ones_are():
    """``expert_slots`` views filled with the experts are the stacked tensors themselves (no copy, no allocation);
    views in the wrong slots (two experts swapped) or a cast are stacked by copying, and the result is still right."""
    from quant.diag.memtrace import LiveBytes
    from quant.models.layers import _layer_state, expert_slots, read_layer_tensors

    src = resolve_model("builtin:deepseek-v3-tiny")
    idx = max(src.moe_layers())
    raw = read_layer_tensors(src, idx)
    _, ref = _layer_state(src, idx, "cpu", "mlp", dict(raw))
    metas = {k: (tuple(t.shape), t.dtype) for k, t in raw.items()}
    assert expert_slots(src, idx, metas, "cpu", torch.float16) == {}  # a cast: nothing to receive into

    def filled():
        slots = expert_slots(src, idx, metas, "cpu")
        assert set(slots) < set(raw) and len(slots) == 3 * ref[0].shape[0]
        return {k: slots[k].copy_(t) if k in slots else t for k, t in raw.items()}

    placed = filled()
    with LiveBytes() as trace:
        _, fused = _layer_state(src, idx, "cpu", "mlp", placed)
    assert trace.peak.bytes < 0.05 * sum(t.numel() * t.element_size() for t in fused)
    assert all(torch.equal(a, b) for a, b in zip(fused, ref, strict=True))
    assert fused[0].data_ptr() == placed[next(k for k in placed if k.endswith(".experts.0.gate_proj.weight"))].data_ptr()

    swapped = filled()
    a, b = (next(k for k in swapped if k.endswith(f".experts.{e}.up_proj.weight")) for e in (0, 1))
    va, vb = swapped[a], swapped[b]
    held = va.clone()
    va.copy_(vb)
    vb.copy_(held)
    swapped[a], swapped[b] = vb, va  # each key's right values, in the other expert's slot
    _, fused = _layer_state(src, idx, "cpu", "mlp", swapped)
    assert all(torch.equal(x, y) for x, y in zip(fused, ref, strict=True))
    assert fused[0].data_ptr() != va.data_ptr()
