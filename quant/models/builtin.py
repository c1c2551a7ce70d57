"""Builtin tiny MoE checkpoints (``builtin:NAME``), deterministic and offline.

Each is built from transformers' own config class, initialized with a fixed seed, given a deliberately biased
router (a shared direction ``u`` is added to every token embedding and to the router rows of a few "hot"
experts, so those experts win the top-k for most tokens, as in real MoEs), and saved with
``save_pretrained`` to ``$QUANT_CACHE/builtin/<name>-<hash>``. From there it loads through exactly the code
path a user's folder takes. The hot experts are recorded in ``quant_builtin.json`` beside the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from quant.errors import ModelError
from quant.io.storage import cache_root, remove_stale

BUILTIN_VERSION = 7
_COMMON = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6)

# name -> (model_type, config kwargs, hot experts per MoE layer)
BUILTINS: dict[str, tuple[str, dict, tuple[int, ...]]] = {
    "qwen3-moe-tiny": ("qwen3_moe", dict(_COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                                         num_experts=16, num_experts_per_tok=4, norm_topk_prob=True), (1, 6, 11)),
    "deepseek-v3-tiny": ("deepseek_v3", dict(_COMMON, intermediate_size=128, moe_intermediate_size=32,
                                             n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                                             first_k_dense_replace=1, n_group=2, topk_group=2, q_lora_rank=32,
                                             kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=16, routed_scaling_factor=1.0, norm_topk_prob=True,
                                             num_key_value_heads=4),
                         (2, 9, 13)),
    "mixtral-tiny": ("mixtral", dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                     head_dim=16), (3,)),
    "olmoe-tiny": ("olmoe", dict(_COMMON, intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                                 norm_topk_prob=False), (0, 7, 12)),
}
DEFAULT_BUILTIN = "qwen3-moe-tiny"
# trained checkpoints that ship with the package (see benchmarks/reference_moe/)
SHIPPED: dict[str, Path] = {"reference-moe": Path(__file__).parent / "assets" / "reference-moe"}
LOGIT_SCALE = 4.0
HOT_SCALE = 0.15  # router logit bonus per unit of the shared direction, for the hottest expert (then 0.75x, 0.5x)


def _spec_hash(name: str) -> str:
    import transformers

    model_type, kwargs, hot = BUILTINS[name]
    blob = json.dumps([BUILTIN_VERSION, model_type, kwargs, hot, transformers.__version__], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def builtin_names() -> list[str]:
    return list(BUILTINS) + list(SHIPPED)


def builtin_path(name: str) -> Path:
    """Folder of builtin ``name``, built (or unpacked) on first use, atomically: temp dir, then rename."""
    if name not in BUILTINS and name not in SHIPPED:
        raise ModelError(f"unknown builtin model '{name}'; builtins: {', '.join(builtin_names())}")
    key = _spec_hash(name) if name in BUILTINS else (SHIPPED[name] / "SHA256SUMS").read_bytes().hex()[:10]
    target = cache_root() / "builtin" / f"{name}-{key}"
    if (target / "quant_builtin.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=f".tmp-{os.getpid()}", dir=target.parent))
    try:
        _build_here_or_apart(name, tmp) if name in BUILTINS else _unpack(SHIPPED[name], tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _unpack(assets: Path, out: Path) -> None:
    """A shipped checkpoint: xz-compressed safetensors shards, checked against SHA256SUMS after unpacking."""
    import lzma

    for f in assets.iterdir():
        if f.suffix == ".xz":
            with lzma.open(f) as src, open(out / f.stem, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        elif f.name != "SHA256SUMS":
            shutil.copy2(f, out / f.name)
    for line in (assets / "SHA256SUMS").read_text().split("\n"):
        if line.strip():
            digest, fname = line.split()
            if hashlib.sha256((out / fname).read_bytes()).hexdigest() != digest:
                raise ModelError(f"shipped checkpoint {assets.name}: {fname} does not match SHA256SUMS (corrupt install?)")
    (out / "quant_builtin.json").write_text(json.dumps({"name": assets.name, "shipped": True}, indent=2))


def _bias_router(model: torch.nn.Module, hot: tuple[int, ...], gen: torch.Generator) -> None:
    """Add a shared unit direction u to every embedding row and HOT_SCALE*u to hot experts' router rows."""
    emb = model.model.embed_tokens.weight
    u = torch.randn(emb.shape[1], generator=gen)
    u = u / u.norm()
    with torch.no_grad():
        emb.add_(emb.abs().mean() * 4.0 * u.to(emb.dtype))
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None or not hasattr(experts, "gate_up_proj"):
                continue
            router = layer.mlp.gate.weight
            for rank, e in enumerate(hot):
                router[e].add_(HOT_SCALE * (1.0 - 0.25 * rank) * u.to(router.dtype))


def _init_experts(model: torch.nn.Module, gen: torch.Generator, std: float) -> None:
    """Fused expert parameters may be left uninitialized by from_config; give them seeded normal weights."""
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None and hasattr(experts, "gate_up_proj"):
                for p in (experts.gate_up_proj, experts.down_proj):
                    p.copy_(torch.randn(p.shape, generator=gen) * std)


def _build_here_or_apart(name: str, out: Path) -> None:
    """``_build`` in this process, or in a child process when this one has joined a process group (torchrun):
    transformers' ``save_pretrained`` then writes the config and weights on rank 0 only, and another rank's
    folder would lack them."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        _build(name, out)
        return
    import subprocess
    import sys

    code = "import sys; from pathlib import Path; from quant.models.builtin import _build; _build(sys.argv[1], Path(sys.argv[2]))"
    p = subprocess.run([sys.executable, "-c", code, name, str(out)], capture_output=True, text=True)
    if p.returncode != 0:
        raise ModelError(f"building builtin model '{name}' failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")


def _build(name: str, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from quant.models.tokenizer import EOS, load_tiny_tokenizer

    model_type, kwargs, hot = BUILTINS[name]
    tok = PreTrainedTokenizerFast(tokenizer_object=load_tiny_tokenizer(), eos_token=EOS, bos_token=EOS,
                                  pad_token=EOS, unk_token=EOS)
    eos_id = tok.convert_tokens_to_ids(EOS)
    config = AutoConfig.for_model(model_type, **kwargs, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1234)
    _init_experts(model, gen, std=config.initializer_range)
    _bias_router(model, hot, gen)
    with torch.no_grad():  # peaked next-token distributions, so quantization error shows in KL / perplexity
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                                               do_sample=False, max_new_tokens=32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "quant_builtin.json").write_text(json.dumps(
        {"name": name, "version": BUILTIN_VERSION, "hot_experts": list(hot), "seed": 0}, indent=2))
