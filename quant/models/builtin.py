"""Builtin tiny MoE checkpoints (``builtin:NAME``), deterministic and offline.

Each is written by quant itself, not by transformers: config.json from the spec below, every tensor of the
family's on-disk layout drawn from a generator seeded by the model's name and the tensor's name (norm weights
1, biases 0, everything else normal with std 0.02), then given a deliberately biased router (a shared direction
``u`` is added to every token embedding and to the router rows of a few "hot" experts, so those experts win the
top-k for most tokens, as in real MoEs) and saved as bf16 safetensors to ``$QUANT_CACHE/builtin/<name>-<hash>``.
The files are therefore the same bytes under any transformers version (a run directory made with one venv opens
in another); transformers only supplies the names and shapes of the family's tensors (built on the meta device).
From the cache a builtin loads through exactly the code path a user's folder takes. The hot experts are
recorded in ``quant_builtin.json`` beside the weights.
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
from quant.io.storage import assets_root, cache_root, remove_stale, sha256_uncached

BUILTIN_VERSION = 8  # 8: written by quant (seeded by tensor name), no longer by transformers' init
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
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}
INIT_STD = 0.02
DEFAULT_BUILTIN = "qwen3-moe-tiny"
# trained checkpoints quant ships (see benchmarks/reference_moe/): name -> the commit of quant's repository that
# holds their files (``<name>/``); main reaches it as a merge parent, so every clone has it, while neither the work
# tree, nor what travels to a GPU host, nor the wheel carries 43 MB of weights. ``assets/<name>.sha256`` pins every
# file's digest: the files are taken from the commit, or from ``$QUANT_ASSETS/<name>/``, only when they match.
SHIPPED: dict[str, str] = {"reference-moe": "314982bd3dee4f4aa8e3fc117614c356c44de62d"}
SHIPPED_SUMS = Path(__file__).parent / "assets"
REPOSITORY = Path(__file__).resolve().parents[2]  # a clone's work tree (quant/models/builtin.py inside it)
LOGIT_SCALE = 4.0
HOT_SCALE = 0.15  # router logit bonus per unit of the shared direction, for the hottest expert (then 0.75x, 0.5x)


def _spec_hash(name: str) -> str:
    """The cache key: what the files are made from (the spec and this module's version; no library version)."""
    model_type, kwargs, hot = BUILTINS[name]
    blob = json.dumps([BUILTIN_VERSION, model_type, kwargs, hot, LOGIT_SCALE, HOT_SCALE, INIT_STD], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def builtin_names() -> list[str]:
    return list(BUILTINS) + list(SHIPPED)


def builtin_path(name: str) -> Path:
    """Folder of builtin ``name``, built (or unpacked) on first use, atomically: temp dir, then rename."""
    if name not in BUILTINS and name not in SHIPPED:
        raise ModelError(f"unknown builtin model '{name}'; builtins: {', '.join(builtin_names())}")
    key = _spec_hash(name) if name in BUILTINS else hashlib.sha256(_pinned(name).read_bytes()).hexdigest()[:10]
    target = cache_root() / "builtin" / f"{name}-{key}"
    if (target / "quant_builtin.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=f".tmp-{os.getpid()}", dir=target.parent))
    try:
        _build(name, tmp) if name in BUILTINS else _unpack(name, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _pinned(name: str) -> Path:
    return SHIPPED_SUMS / f"{name}.sha256"


def _digests(name: str) -> dict[str, str]:
    """File name -> SHA-256 of every file shipped as ``name`` (as stored: shards xz-compressed)."""
    return {f: d for d, f in (line.split() for line in _pinned(name).read_text().splitlines() if line.strip())}


def _git_file(name: str, file: str, out: Path) -> bool:
    """``<name>/<file>`` of the commit ``SHIPPED[name]`` of the repository quant runs from, into ``out``; False
    when there is no such repository, git, or commit (an installed wheel, a shallow clone)."""
    import subprocess

    if not (REPOSITORY / ".git").exists():
        return False
    try:
        with open(out, "wb") as f:
            done = subprocess.run(["git", "-C", str(REPOSITORY), "cat-file", "blob", f"{SHIPPED[name]}:{name}/{file}"],
                                  stdout=f, stderr=subprocess.DEVNULL, check=False)
    except OSError:  # no git
        return False
    return done.returncode == 0


def _fetch_shipped(name: str, into: Path) -> None:
    """Every file shipped as ``name`` into ``into``, from ``$QUANT_ASSETS/<name>/`` or the repository's commit, each
    checked against the pinned digests."""
    folder = assets_root()
    for file, digest in _digests(name).items():
        out = into / file
        if folder is not None and (folder / name / file).is_file():
            shutil.copyfile(folder / name / file, out)
        elif not _git_file(name, file, out):
            where = f"{folder / name} has no {file}, and " if folder is not None else ""
            raise ModelError(f"builtin:{name} is not in this copy of quant: {where}its files live in commit "
                             f"{SHIPPED[name][:12]} of quant's git repository, which {REPOSITORY} is not a full "
                             f"clone of; use a git clone (not shallow), or set QUANT_ASSETS to a folder holding "
                             f"{name}/ (`git archive {SHIPPED[name][:12]} {name} | tar -x -C FOLDER` in a clone)")
        if sha256_uncached(out) != digest:
            raise ModelError(f"builtin:{name}: {file} does not match its pinned SHA-256 (quant/models/assets/"
                             f"{name}.sha256); the copy it came from is damaged or another version")


def _unpack(name: str, out: Path) -> None:
    """A shipped checkpoint: its files fetched (``_fetch_shipped``), the xz-compressed safetensors shards unpacked,
    and checked against the SHA256SUMS shipped with them."""
    import lzma

    stored = out / ".shipped"
    stored.mkdir()
    _fetch_shipped(name, stored)
    for f in sorted(stored.iterdir()):
        if f.suffix == ".xz":
            with lzma.open(f) as src, open(out / f.stem, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        elif f.name != "SHA256SUMS":
            shutil.copy2(f, out / f.name)
    for line in (stored / "SHA256SUMS").read_text().split("\n"):
        if line.strip():
            digest, fname = line.split()
            if sha256_uncached(out / fname) != digest:
                raise ModelError(f"shipped checkpoint {name}: {fname} does not match SHA256SUMS (corrupt install?)")
    shutil.rmtree(stored)
    (out / "quant_builtin.json").write_text(json.dumps({"name": name, "shipped": True}, indent=2))


def seeded_tensor(model: str, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of tensor ``key`` of builtin ``model`` (float32): ones for a norm weight, zeros for a bias,
    else normal(0, INIT_STD) from a generator seeded by the model's and the tensor's names."""
    leaf = key.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    if key.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in leaf:
        return torch.ones(shape)
    seed = int.from_bytes(hashlib.sha256(f"{model}/{key}".encode()).digest()[:8], "little") >> 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * INIT_STD


def _config(name: str, eos_id: int) -> dict:
    model_type, kwargs, _ = BUILTINS[name]
    return {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type, **kwargs,
            "initializer_range": INIT_STD, "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id,
            "dtype": "bfloat16"}


def _bias_router(name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Add a shared unit direction u to every embedding row and HOT_SCALE*u to hot experts' router rows."""
    from quant.models.families import family_for

    model_type, _, hot = BUILTINS[name]
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{name}/router".encode()).digest()[:4], "little"))
    emb = tensors["model.embed_tokens.weight"]
    u = torch.randn(emb.shape[1], generator=gen)
    u = u / u.norm()
    emb.add_(emb.abs().mean() * 4.0 * u)
    fam = family_for(model_type)
    for key, router in tensors.items():
        if fam.canonical(key) is not None and fam.canonical(key).endswith(".router"):
            for rank, e in enumerate(hot):
                router[e].add_(HOT_SCALE * (1.0 - 0.25 * rank) * u)


def _build(name: str, out: Path) -> None:
    from safetensors.torch import save_file

    from quant.models.synthetic import disk_shapes
    from quant.models.tokenizer import EOS, load_tiny_tokenizer

    model_type, kwargs, hot = BUILTINS[name]
    tokenizer = load_tiny_tokenizer()
    eos_id = tokenizer.token_to_id(EOS)
    config = _config(name, eos_id)
    ids = dict(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    shapes = disk_shapes(model_type, dict(kwargs, **ids))
    tensors = {k: seeded_tensor(name, k, shape) for k, shape in sorted(shapes.items())}
    _bias_router(name, tensors)
    tensors["lm_head.weight"].mul_(LOGIT_SCALE)  # peaked next-token distributions: quantization error shows in KL
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False,
         "max_new_tokens": 32}, indent=2, sort_keys=True) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
         "unk_token": EOS, "model_max_length": kwargs["max_position_embeddings"]}, indent=2, sort_keys=True) + "\n")
    (out / "quant_builtin.json").write_text(json.dumps(
        {"name": name, "version": BUILTIN_VERSION, "hot_experts": list(hot)}, indent=2))
