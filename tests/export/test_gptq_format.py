"""GPTQ-format checkpoints, read back the way serving runtimes read them.

``GptqReader`` below is a test-only reader written from the layout facts in docs/runtimes.md §2 (vLLM's GPTQ
layout), independent of quant/export/gptq.py: ``qweight [K*b/32, N]`` int32 packed along K, least significant
bits first; ``qzeros [K/g, N*b/32]`` packed along N (v1: stored zero - 1; ``gptq_v2``: as is); ``scales
[K/g, N]`` fp16; ``g_idx [K]``; ``W[n, k] = scales[g_idx[k], n] * (u[k, n] - zero[g_idx[k], n])``. Each module's
scheme is the base one overridden by the first ``dynamic`` rule whose pattern ``re.match``es its name (``-:``
rules skip the module: it stays a bf16 ``.weight``).

Runs (in-process, up to export): qwen3-moe-tiny with a per-expert 8/4 plan, symmetric; olmoe-tiny with a
per-expert 8/4 plan, asymmetric, both at ``plan.group_size=32``; GPTQModel's torch kernel takes their 32/64
in/out features as they are. (The headline's 128 gives the same plans: the planner fits one group size to every
projection of an expert, 32 on these models, since one ``dynamic`` rule per expert holds one group size.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quant.models import resolve_model
from quant.plan.bitplan import BitPlan
from quant.quantize.qstore import dequantize_2d, layer_file, read_layer
from tests.conftest import REPO

RECIPE = REPO / "recipes" / "mixed_int8_int4.yaml"
SMALL = ("calibration.n_samples=4", "calibration.seq_len=32", "plan.group_size=32")
RUNS = {  # id -> (builtin, symmetric)
    "qwen3-sym": ("qwen3-moe-tiny", True),
    "olmoe-asym": ("olmoe-tiny", False),
}
GPTQ_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


# ----------------------------------------------------------------------------------------------- the reader
def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit fields of int32 ``words``, least significant first, laid out along ``dim``."""
    per = 32 // bits
    x = words.to(torch.int64) & 0xFFFFFFFF
    fields = [(x >> (bits * i)) & ((1 << bits) - 1) for i in range(per)]
    out = torch.stack(fields, dim=dim + 1)  # word j, field i -> element j * per + i along dim
    shape = list(words.shape)
    shape[dim] *= per
    return out.reshape(shape)


def resolve_scheme(qcfg: dict, module: str) -> dict | None:
    """``{bits, group_size, sym}`` for ``module`` (base + first matching dynamic rule); None if ``-:`` skips it."""
    scheme = {"bits": qcfg["bits"], "group_size": qcfg["group_size"], "sym": qcfg["sym"]}
    for rule, override in (qcfg.get("dynamic") or {}).items():
        negative = rule.startswith("-:")
        pattern = rule[2:] if rule[:2] in ("+:", "-:") else rule
        if re.match(pattern, module):
            return None if negative else {k: override.get(k, v) for k, v in scheme.items()}
    return scheme


@dataclass
class GptqModule:
    bits: int
    group_size: int
    sym: bool
    codes: torch.Tensor  # [K, N] unsigned
    zeros: torch.Tensor  # [K/g, N] unsigned zero points (v1 already corrected)
    scales: torch.Tensor  # [K/g, N] fp16
    g_idx: torch.Tensor  # [K]

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized ``[N, K]`` (computed exactly in fp32, rounded once to ``dtype``)."""
        g = self.g_idx.long()
        w = self.scales[g].float() * (self.codes - self.zeros[g]).float()
        return w.T.contiguous().to(dtype)


class GptqReader:
    """A GPTQ checkpoint folder: ``quantize_config.json`` (the same dict as config.json's quantization_config,
    which is what vLLM reads), and every tensor by name."""

    def __init__(self, ckpt: Path):
        self.qcfg = json.loads((ckpt / "quantize_config.json").read_text())
        assert json.loads((ckpt / "config.json").read_text())["quantization_config"] == self.qcfg
        assert self.qcfg["quant_method"] == "gptq" and self.qcfg.get("pack_dtype", "int32") == "int32"
        assert not self.qcfg["desc_act"]
        self.v2 = self.qcfg["checkpoint_format"] == "gptq_v2"
        files = ["model.safetensors"]
        if (ckpt / "model.safetensors.index.json").is_file():
            files = sorted(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()))
        self.tensors: dict[str, torch.Tensor] = {}
        for f in files:
            self.tensors.update(load_file(str(ckpt / f)))

    def quantized_modules(self) -> list[str]:
        return sorted(k.removesuffix(".qweight") for k in self.tensors if k.endswith(".qweight"))

    def module(self, name: str) -> GptqModule:
        s = resolve_scheme(self.qcfg, name)
        assert s is not None, f"{name} has a qweight but a '-:' rule skips it"
        bits, g = s["bits"], s["group_size"]
        qweight, qzeros = self.tensors[f"{name}.qweight"], self.tensors[f"{name}.qzeros"]
        scales, g_idx = self.tensors[f"{name}.scales"], self.tensors[f"{name}.g_idx"]
        assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32 and scales.dtype == torch.float16
        N = qweight.shape[1]
        K = qweight.shape[0] * 32 // bits
        assert g > 0 and K % g == 0, (name, K, g)
        assert tuple(scales.shape) == (K // g, N) and tuple(qzeros.shape) == (K // g, N * bits // 32), name
        assert tuple(g_idx.shape) == (K,), name
        zeros = _unpack(qzeros, bits, dim=1)
        return GptqModule(bits, g, s["sym"], _unpack(qweight, bits, dim=0), zeros if self.v2 else zeros + 1,
                          scales, g_idx)


def test_reader_unpacks_hand_made_words():
    # 0x76543210: fields 0..7 along K (rows); v1 symmetric 4-bit zero word 0x77777777 means zero 8
    qweight = torch.tensor([[0x76543210 - (1 << 32)]], dtype=torch.int64).to(torch.int32)
    assert _unpack(qweight, 4, dim=0)[:, 0].tolist() == list(range(8))
    qzeros = torch.tensor([[0x77777777]], dtype=torch.int32)
    assert (_unpack(qzeros, 4, dim=1) + 1).tolist() == [[8] * 8]
    assert _unpack(torch.tensor([[0x04030201]], dtype=torch.int32), 8, dim=1).tolist() == [[1, 2, 3, 4]]
    qcfg = {"bits": 4, "group_size": 32, "sym": True,
            "dynamic": {r"-:model\.layers\.1\.self_attn\.": {}, r"+:model\.layers\.1\.mlp\.experts\.(2|3)\.": {"bits": 8},
                        r"+:model\.layers\.1\.": {"bits": 2}}}
    assert resolve_scheme(qcfg, "model.layers.1.self_attn.q_proj") is None
    assert resolve_scheme(qcfg, "model.layers.1.mlp.experts.3.up_proj")["bits"] == 8
    assert resolve_scheme(qcfg, "model.layers.1.mlp.experts.30.up_proj")["bits"] == 2  # "30" is not "3\."
    assert resolve_scheme(qcfg, "model.layers.10.mlp.experts.3.up_proj")["bits"] == 4


# ------------------------------------------------------------------------------------------------ fixtures
@dataclass
class Run:
    dir: Path
    source: object
    plan: BitPlan

    @property
    def ckpt(self) -> Path:
        return self.dir / "checkpoint-gptq"


@pytest.fixture(scope="module")
def runs(quant_cache, tmp_path_factory) -> dict[str, Run]:
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    out = {}
    for run_id, (builtin, sym) in RUNS.items():
        overrides = (*SMALL, f"plan.symmetric={str(sym).lower()}", "export.formats=[compressed-tensors,gptq]")
        recipe = load_recipe(RECIPE, overrides=overrides, model=f"builtin:{builtin}")
        run_dir = tmp_path_factory.mktemp(run_id)
        run(recipe, run_dir, until="export")
        out[run_id] = Run(run_dir, resolve_model(f"builtin:{builtin}"), BitPlan.load(run_dir / "plan.json"))
    return out


def quant_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``quant ARGS`` through the console entry point (``quant.cli.main``) in this process: exit code, stdout,
    stderr. In-process because a subprocess pays ~10 s of imports per call on 2 cores; ``main`` is the same
    code path (argv parsing, error -> one line, exit code)."""
    from quant.cli import main

    capsys.readouterr()
    argv = sys.argv
    sys.argv = ["quant", *args]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, out.out, out.err


def _stored(run: Run) -> dict:
    """canonical name -> QuantizedWeight, from the quantize stage's store."""
    out = {}
    for layer in sorted({m.layer for m in run.source.modules.values()}, key=lambda x: -1 if x is None else x):
        path = layer_file(run.dir / "quantized", layer)
        if path.is_file():
            out.update(read_layer(path))
    return out


# --------------------------------------------------------------------------------------- reader round trip
@pytest.mark.parametrize("run_id", list(RUNS))
def test_plan_mixes_bits_within_a_layer(runs, run_id):
    r = runs[run_id]
    by_layer: dict[int, set] = {}
    for name, m in r.source.modules.items():
        if m.kind == "expert":
            by_layer.setdefault(m.layer, set()).add(r.plan.modules[name].bits)
    assert all(bits == {4, 8} for bits in by_layer.values()), by_layer
    assert {p.symmetric for p in r.plan.quantized().values()} == {RUNS[run_id][1]}


@pytest.mark.parametrize("run_id", list(RUNS))
def test_codes_zeros_scales_and_weights_round_trip(runs, run_id):
    r = runs[run_id]
    reader = GptqReader(r.ckpt)
    sym = RUNS[run_id][1]
    assert reader.qcfg["checkpoint_format"] == ("gptq" if sym else "gptq_v2")
    rules = list(reader.qcfg["dynamic"])
    signs = [k.startswith("-:") for k in rules]
    assert signs == sorted(signs, reverse=True), "GPTQModel moves '-:' rules first; the file must already say so"
    stored = _stored(r)
    disk_to_canonical = {m.disk_prefix: n for n, m in r.source.modules.items()}
    quantized = {r.source.modules[n].disk_prefix for n in r.plan.quantized()}
    assert set(reader.quantized_modules()) == quantized
    for disk in reader.quantized_modules():
        name = disk_to_canonical[disk]
        plan, qw, mod = r.plan.modules[name], stored[name], reader.module(disk)
        assert (mod.bits, mod.group_size, mod.sym) == (plan.bits, plan.group_size, plan.symmetric), disk
        assert (qw.spec.bits, qw.spec.group_size, qw.spec.symmetric) == (plan.bits, plan.group_size, plan.symmetric)
        offset = 1 << (mod.bits - 1)
        N, K = qw.q.shape
        assert torch.equal(mod.g_idx, torch.arange(K, dtype=torch.int32) // mod.group_size), disk
        assert torch.equal(mod.codes - offset, qw.q.T.to(torch.int64)), disk
        if sym:
            assert bool((mod.zeros == offset).all()), disk
            word = {4: 0x77777777, 8: 0x7F7F7F7F}[mod.bits]  # v1: zero - 1 in every field
            assert bool((reader.tensors[f"{disk}.qzeros"] == word).all()), disk
        else:
            assert torch.equal(mod.zeros - offset, qw.zero.T.to(torch.int64)), disk
        assert torch.equal(mod.scales.float(), qw.scale.T.float()), f"{disk}: scale not representable in fp16"
        ours = dequantize_2d(qw)
        assert ours.dtype == torch.bfloat16
        assert torch.equal(mod.weight(ours.dtype), ours), disk
        assert not torch.equal(ours, r.source.read_tensors([f"{disk}.weight"])[f"{disk}.weight"])
    # everything else (kept modules, norms, router, embeddings) is the source tensor, bit for bit
    rest = [k for k in reader.tensors if not k.endswith(GPTQ_SUFFIXES)]
    assert set(rest) == {k for k in r.source.weight_map if k.removesuffix(".weight") not in quantized}
    src = r.source.read_tensors(rest)
    for k in rest:
        assert torch.equal(reader.tensors[k], src[k]), k


@pytest.mark.parametrize("run_id", list(RUNS))
def test_quant_inspect_table_equals_plan(runs, run_id, capsys):
    r = runs[run_id]
    code, stdout, stderr = quant_cli(capsys, "inspect", str(r.ckpt))
    assert code == 0, stderr[-2000:]
    rows = [ln.split("\t") for ln in stdout.strip().splitlines() if not ln.startswith("#")]
    assert rows[0] == ["module", "bits", "group", "sym"]
    table = {row[0]: tuple(row[1:]) for row in rows[1:]}
    expected = {}
    for name, m in r.source.modules.items():
        if m.kind == "embed":
            continue  # inspect lists quantized and kept 2-D weights, not the embedding table
        s = r.plan.modules[name]
        expected[m.disk_prefix] = ("keep", "-", "-") if s.keep else (str(s.bits), str(s.group_size), str(s.symmetric))
    assert table == expected
    assert list(table) == [ln[0] for ln in rows[1:]]
    w8 = sum(1 for s in r.plan.modules.values() if s.bits == 8)
    assert f"W8={w8}" in stdout.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------- GPTQModel (reference)
# Runs in a subprocess: GPTQModel patches transformers' MoE block classes process-wide on load, which must not
# leak into the rest of the test session. torch.compile is disabled (TorchLinear compiles its dequantizer,
# minutes of inductor on 2 cores); the eager kernel computes the same thing.
GPTQMODEL_SCRIPT = r"""
import json, sys, torch
from safetensors.torch import save_file
from gptqmodel import BACKEND, GPTQModel
from gptqmodel.nn_modules.qlinear import BaseQuantLinear
ids = torch.tensor(json.loads(sys.argv[1]))
for ckpt, out in zip(sys.argv[2::2], sys.argv[3::2]):
    m = GPTQModel.load(ckpt, device="cpu", backend=BACKEND.GPTQ_TORCH)
    tensors, schemes = {}, {}
    with torch.no_grad():
        tensors["logits"] = m.model(input_ids=ids).logits.float()
        for name, mod in m.model.named_modules():
            if isinstance(mod, BaseQuantLinear):
                schemes[name] = [type(mod).__name__, mod.bits, mod.group_size, bool(mod.sym)]
                tensors[name] = mod.dequantize_weight().T.contiguous()
    save_file(tensors, out, metadata={"schemes": json.dumps(schemes)})
"""


def _fake_quant_logits(r: Run, ids: torch.Tensor, tmp: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the source model with every quantized weight replaced by our dequantization, base logits)."""
    from transformers import AutoModelForCausalLM

    tensors = r.source.read_tensors(list(r.source.weight_map))
    for name, qw in _stored(r).items():
        tensors[r.source.modules[name].disk_prefix + ".weight"] = dequantize_2d(qw)
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text((r.source.path / "config.json").read_text())
    out = []
    for path in (tmp, r.source.path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            out.append(model(input_ids=ids).logits.float())
    return out[0], out[1]


@pytest.mark.reference
@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel is not installed")
def test_gptqmodel_loads_per_expert_mixed_checkpoints(runs, tmp_path):
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(0))
    args = []
    for run_id in RUNS:
        args += [str(runs[run_id].ckpt), str(tmp_path / f"{run_id}.safetensors")]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "GPTQMODEL_CPU_WORKERS": "2"}
    p = subprocess.run([sys.executable, "-c", GPTQMODEL_SCRIPT, json.dumps(ids.tolist()), *args],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    for run_id in RUNS:
        r = runs[run_id]
        path = tmp_path / f"{run_id}.safetensors"
        with safe_open(str(path), "pt") as f:
            schemes = json.loads(f.metadata()["schemes"])
        got = load_file(str(path))
        # GPTQModel resolves every module to the plan's scheme and dequantizes it to exactly our weights
        expected = {m.disk_prefix: r.plan.modules[n] for n, m in r.source.modules.items() if not r.plan.modules[n].keep}
        assert set(schemes) == set(expected), sorted(set(schemes) ^ set(expected))[:5]
        stored = {r.source.modules[n].disk_prefix: qw for n, qw in _stored(r).items()}
        for disk, (kernel, bits, group, sym) in schemes.items():
            plan = expected[disk]
            assert kernel == "TorchLinear" and (bits, group, sym) == (plan.bits, plan.group_size, plan.symmetric), disk
            assert torch.equal(got[disk].to(torch.bfloat16), dequantize_2d(stored[disk])), disk
        fake, base = _fake_quant_logits(r, ids, tmp_path / f"{run_id}-dense")
        logits = got["logits"]
        # the weights are ours bit for bit (above): what differs is bf16 accumulation order through every layer
        # (GPTQModel's TorchLinear against nn.Linear), a few elements in 10^4 beyond 1 % of the largest logit
        tol = 2e-2 * fake.abs().max().item()
        torch.testing.assert_close(logits, fake, rtol=1.6e-2, atol=tol)
        assert (logits - fake).abs().max() < (logits - base).abs().max(), "closer to the base model than to ours"
        assert (logits.argmax(-1) == fake.argmax(-1)).float().mean() > 0.97


# ------------------------------------------------------------------------------------------------- Mixtral
def test_mixtral_gptq_for_gptqmodel_is_refused(tmp_path, capsys):
    code, _, stderr = quant_cli(capsys, "plan", str(RECIPE), "--model", "builtin:mixtral-tiny", "-o", str(tmp_path / "r"),
                                "--set", "calibration.n_samples=2", "--set", "calibration.seq_len=16",
                                "--set", "plan.group_size=32", "--set", "plan.target_runtime=gptqmodel",
                                "--set", "export.formats=[gptq]")
    assert code == 1, (code, stderr[-2000:])
    errors = [ln for ln in stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, stderr[-2000:]
    assert "plan cannot be served by gptqmodel" in errors[0]
    assert "block_sparse_moe.experts.N.w1" in errors[0] and "vllm" in errors[0]
    assert not (tmp_path / "r" / "plan.json").exists()


# ------------------------------------------------------------------------------------- vLLM guard (per expert)
def _vllm_refuses(qcfg: dict) -> list[str]:
    """vLLM 0.33's GPTQ config check (``normalize_and_validate_gptq_desc_act``, run when it builds the config):
    any ``+:`` rule enabling desc_act with a group size other than -1 raises. Returns the offending rules."""
    base_g = qcfg["group_size"]
    return [r for r, o in qcfg["dynamic"].items()
            if not r.startswith("-:") and o.get("desc_act", qcfg["desc_act"]) and o.get("group_size", base_g) != -1]


def test_per_expert_checkpoint_carries_a_guard_vllm_refuses(runs):
    """vLLM matches rules against the fused MoE prefix and would narrow other-bit experts into expert 0's buffers
    silently; the guard rule matches only that prefix (never a per-expert module, so GPTQModel ignores it, as the
    GPTQModel test above shows) and trips vLLM's config check."""
    r = runs["qwen3-sym"]
    reader = GptqReader(r.ckpt)
    guards = _vllm_refuses(reader.qcfg)
    mixed = sorted({m.layer for n, m in r.source.modules.items() if m.kind == "expert"
                    and r.plan.modules[n].bits != r.plan.modules[f"layers.{m.layer}.experts.0.up"].bits})
    assert mixed and len(guards) == 1
    pattern = guards[0][2:]
    assert "vLLM cannot serve it" in pattern
    assert [L for L in range(r.source.n_layers) if re.match(pattern, f"model.layers.{L}.mlp.experts")] == mixed
    assert not [n for n in reader.quantized_modules() if re.match(pattern, n)]


def test_per_layer_checkpoint_has_no_guard(tmp_path):
    from quant.export.gptq import quantize_config
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    recipe = load_recipe(RECIPE, overrides=(*SMALL, "plan.granularity=per_layer", "plan.target_runtime=vllm",
                                            "export.formats=[compressed-tensors,gptq]"))
    run(recipe, tmp_path, until="plan")
    qcfg = quantize_config(BitPlan.load(tmp_path / "plan.json"), resolve_model("builtin:qwen3-moe-tiny"))
    assert _vllm_refuses(qcfg) == [] and any("experts" in rule for rule in qcfg["dynamic"])


# -------------------------------------------------------------------- GPTQModel's default CPU kernel (group 16)
GENERATE_SCRIPT = r"""
import sys
from gptqmodel import BACKEND, GPTQModel
kw = {"backend": getattr(BACKEND, sys.argv[2])} if len(sys.argv) > 2 else {}
model = GPTQModel.load(sys.argv[1], **kw)
print("GENERATED", len(model.generate("Hello")[0]))
"""


@pytest.mark.reference
@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel is not installed")
def test_group_16_needs_the_backend_the_card_names(tmp_path):
    """The card's GPTQModel snippet names BACKEND.TORCH for 4-bit groups outside 32/64/128/256: the default CPU
    kernel (TorchAtenLinear) fails at generate, the named one works."""
    from quant.card import write_cards
    from quant.recipe import load_recipe
    from quant.run.pipeline import run

    recipe = load_recipe(RECIPE, overrides=("calibration.n_samples=4", "calibration.seq_len=32", "plan.group_size=16",
                                            "export.formats=[gptq]"))
    run(recipe, tmp_path / "r", until="export")
    write_cards(recipe, resolve_model("builtin:qwen3-moe-tiny"), tmp_path / "r")
    card = (tmp_path / "r" / "checkpoint" / "README.md").read_text()
    assert 'GPTQModel.load("ORG/NAME", backend=BACKEND.TORCH)' in card and "TorchAtenLinear" in card
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "GPTQMODEL_CPU_WORKERS": "2"}
    ckpt = str(tmp_path / "r" / "checkpoint")
    default = subprocess.run([sys.executable, "-c", GENERATE_SCRIPT, ckpt], capture_output=True, text=True,
                             timeout=600, env=env, cwd=tmp_path)
    assert default.returncode != 0 and "qGroupSize" in default.stderr, default.stderr[-2000:]
    torch_backend = subprocess.run([sys.executable, "-c", GENERATE_SCRIPT, ckpt, "TORCH"], capture_output=True,
                                   text=True, timeout=600, env=env, cwd=tmp_path)
    assert torch_backend.returncode == 0 and "GENERATED" in torch_backend.stdout, torch_backend.stderr[-2000:]
