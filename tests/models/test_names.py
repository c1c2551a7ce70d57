"""Canonical names are built and parsed in models/ alone: the helpers agree with every builtin family's modules;
family facts other packages ask (expert names GPTQModel reads, the blocks GPTQ rules address) are attributes."""

from __future__ import annotations

import re

import pytest

from quant.models import BUILTINS, resolve_model
from quant.models.families import FAMILIES, layer_rule
from quant.models.names import Name, block_name, expert_name, layer_prefix, parse
from quant.models.source import layer_of_key


def test_parse_takes_each_kind_of_name_apart():
    assert parse("layers.3.experts.17.up") == Name(3, "experts", 17, "up")
    assert parse("layers.3.attn.kv_a_proj_with_mqa") == Name(3, "attn", None, "kv_a_proj_with_mqa")
    assert parse("layers.0.shared_gate") == Name(0, None, None, "shared_gate")
    assert parse("lm_head") == Name(None, None, None, "lm_head")
    assert [parse(n).kind for n in ("layers.1.router", "layers.1.mlp.down", "layers.1.shared.up", "embed")] == [
        "router", "dense_mlp", "shared", "embed"]


@pytest.mark.parametrize("builtin", list(BUILTINS))
def test_helpers_agree_with_every_module_of_a_family(quant_cache, builtin):
    src = resolve_model(f"builtin:{builtin}")
    for name, m in src.modules.items():
        n = parse(name)
        assert (n.kind, n.layer, n.expert) == (m.kind, m.layer, m.expert), name
        if m.kind == "expert":
            assert name == expert_name(m.layer, m.expert, n.leaf)
        elif m.layer is not None:
            assert name.startswith(layer_prefix(m.layer))
            assert name == (f"{block_name(m.layer, n.block)}.{n.leaf}" if n.block else f"{layer_prefix(m.layer)}{n.leaf}")
    for layer in range(src.n_layers):
        assert src.layer_keys(layer) == [k for k in src.weight_map if layer_of_key(k) == layer]
        assert src.layer_keys(layer)


@pytest.mark.parametrize("builtin", list(BUILTINS))
def test_rule_blocks_match_the_on_disk_names_of_their_modules(quant_cache, builtin):
    """The block regex GPTQ dynamic rules use for a module matches that module's on-disk name (and only modules of
    its layer); Mixtral alone keeps expert names GPTQModel cannot read."""
    src = resolve_model(f"builtin:{builtin}")
    fam = src.family
    for name, m in src.modules.items():
        where = fam.rule_block(name)
        if m.kind in ("router", "embed", "lm_head"):
            assert where is None, name
            continue
        layer, block, expert = where
        assert (layer, expert) == (m.layer, m.expert)
        pattern = re.compile(layer_rule(str(layer), block))
        assert pattern.match(m.disk_prefix), (name, pattern.pattern)
        assert not any(pattern.match(o.disk_prefix) for o in src.modules.values() if o.layer != layer)
    assert fam.standard_expert_names == (fam.name != "mixtral")
    assert FAMILIES["mixtral"].expert_gate_names == "block_sparse_moe.experts.N.w1"
