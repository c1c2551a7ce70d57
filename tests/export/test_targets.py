import random
import re

import pytest

from quant.export.targets import name_regexes


def _universe():
    names = []
    for L in range(6):
        names += [f"model.layers.{L}.self_attn.{p}_proj" for p in "qkvo"]
        names += [f"model.layers.{L}.mlp.gate"]
        names += [f"model.layers.{L}.mlp.experts.{e}.{p}_proj" for e in range(12) for p in ("gate", "up", "down")]
    return names + ["lm_head"]


def _matched(patterns, universe):
    return {n for n in universe if any(re.match(p, n) for p in patterns)}


def test_exact_on_random_subsets():
    uni = _universe()
    rng = random.Random(0)
    for _ in range(40):
        chosen = rng.sample(uni, rng.randint(1, len(uni)))
        pats = name_regexes(chosen, uni)
        assert _matched(pats, uni) == set(chosen)


def test_compact_for_structured_sets():
    uni = _universe()
    all_experts = [n for n in uni if ".experts." in n]
    assert name_regexes(all_experts, uni) == [r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(up_proj|down_proj|gate_proj)$"]
    hot = [n for n in all_experts if n.split(".")[5] in ("1", "6")]
    pats = name_regexes(hot, uni)
    assert len(pats) == 1 and r"experts\.(1|6)\." in pats[0]
    layer3 = [n for n in all_experts if n.startswith("model.layers.3.")]
    assert name_regexes(layer3, uni) == [r"^model\.layers\.3\.mlp\.experts\.\d+\.(up_proj|down_proj|gate_proj)$"]


def test_layer_numbers_do_not_prefix_match():
    uni = [f"model.layers.{L}.self_attn.q_proj" for L in range(12)]
    pats = name_regexes(["model.layers.1.self_attn.q_proj"], uni)
    assert _matched(pats, uni) == {"model.layers.1.self_attn.q_proj"}


def _gptq_rules(names: list[str]) -> list[str]:
    """Patterns in the shapes quant's GPTQ writer gives its dynamic rules (export.gptq.dynamic_rules)."""
    from quant.export.gptq import VLLM_GUARD

    return [r"model\.layers\.(1|3|5)\.mlp\.experts", r"model\.layers\.3\.mlp\.experts\.(1|6|11)\.",
            r"model\.layers\.(0|2)\.self_attn\.", r"model\.layers\.(1|4)\.mlp\.experts$" + VLLM_GUARD,
            r"model\.layers\.(0|1)\.(mlp|block_sparse_moe)\.experts", r"model\.layers\.2\.mlp\.(gate_proj|up_proj)"]


def test_the_compact_matcher_agrees_with_re_on_what_quant_writes():
    from quant.export.targets import compact_match, compile_compact

    uni = _universe()
    rng = random.Random(1)
    patterns = _gptq_rules(uni)
    for _ in range(30):
        patterns += name_regexes(rng.sample(uni, rng.randint(1, len(uni))), uni)
    for p in patterns:
        compiled = compile_compact(p)
        assert {n for n in uni if compact_match(compiled, n)} == {n for n in uni if re.match(p, n)}, p


def test_the_compact_matcher_agrees_with_re_on_hand_made_cases():
    from quant.export.targets import compact_match, compile_compact

    cases = [(r"^a(1|12)\.b$", ["a1.b", "a12.b", "a12.bc", "a123.b"]), (r"x\d+y", ["x1y", "xy", "x12y3", "x١٢y"]),
             (r"(|ab)c", ["c", "abc", "ac"]), (r"a\-b\ c$", ["a-b c", "a-b c\n", "a-b cd"]), ("^$", ["", "\n", "a"]),
             (r"\\", ["\\", "a"]), (r"(?#any comment; here)ab$(?#end)", ["ab", "abc"])]
    for pattern, names in cases:
        compiled = compile_compact(pattern)
        for n in names:
            assert compact_match(compiled, n) == (re.match(pattern, n) is not None), (pattern, n)


@pytest.mark.parametrize("pattern", [r"^(.*)*(.*)*Z$", ".*", "a+", "a?", "a{2}", "[0-9]", "a|b", r"\w", "(a(b))",
                                     "(?i)a", r"a$b", "(ab", "a)", "^^a", r"\d", "a\\"])
def test_other_regexes_are_refused(pattern):
    from quant.export.targets import NotCompact, compile_compact

    with pytest.raises(NotCompact):
        compile_compact(pattern)


def test_inspect_refuses_a_catastrophic_target_at_once(tmp_path, quant_cache):
    """Before: `quant inspect` ran at full CPU past 60 s (hours: re backtracks through every split of the name) and
    ignored Ctrl-C."""
    import json
    import shutil
    import time

    import torch
    from safetensors.torch import load_file, save_file

    from quant.models.builtin import builtin_path
    from tests.conftest import run_cli

    ckpt = tmp_path / "ckpt"
    shutil.copytree(builtin_path("qwen3-moe-tiny"), ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.up_proj.weight_packed"] = torch.zeros(32, 8, dtype=torch.int32)
    save_file(tensors, ckpt / "model.safetensors")
    group = {"targets": ["re:^(.*)*(.*)*(.*)*(.*)*Z$"], "weights": {"num_bits": 4, "group_size": 32, "symmetric": True}}
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"g": group}}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    proc = run_cli("inspect", str(ckpt), timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "is not of the form quant writes" in lines[0], proc.stderr
    assert time.perf_counter() - t0 < 60
