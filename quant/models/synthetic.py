"""Synthetic models of real layer shapes: random weights saved as real checkpoints, and tiled views of them.

For benchmarks and GPU tests that need a model of a real architecture's shapes (Qwen3-30B-A3B, DeepSeek-V3,
Mixtral-8x7B) without its weights: ``build_model`` saves a seeded random-weight model (transformers' own modules and
``save_pretrained``, so the files are what a real checkpoint's are) with a word-level tokenizer over its whole
vocabulary; ``write_shapes_only`` writes the headers alone (what ``quant estimate`` reads); ``TiledSource`` reads a
K-layer checkpoint as N layers (layer i from saved layer i mod K) to time a full-depth run without N layers on disk.
The ``serve-*`` shapes are the smallest each family's vLLM kernels accept (hidden a multiple of 128, expert
intermediate a multiple of 128).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from quant.models.source import ModelSource

SHAPES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
                          tie_word_embeddings=False),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=32000, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=0,
                        n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True,
                        max_position_embeddings=4096, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False),
    "tiny": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512,
                 moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False),
}

_SERVE = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=1024, tie_word_embeddings=False)
SHAPES |= {
    "serve-qwen3-moe": dict(_SERVE, model_type="qwen3_moe", intermediate_size=512, moe_intermediate_size=256,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    # narrower than Marlin MoE tiles (hidden 64): vLLM runs its Triton MoE kernel, SGLang has none
    "serve-qwen3-narrow": dict(_SERVE, model_type="qwen3_moe", hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "serve-mixtral": dict(_SERVE, model_type="mixtral", intermediate_size=256, num_local_experts=8,
                          num_experts_per_tok=2),
    "serve-olmoe": dict(_SERVE, model_type="olmoe", intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=False, num_key_value_heads=4),
    # MLA at DeepSeek-V3's own head sizes (vLLM's MLA kernels are built for them), one dense first layer
    "serve-deepseek-v3": dict(_SERVE, model_type="deepseek_v3", hidden_size=512, intermediate_size=512,
                              moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=8,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                              n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=1.0, norm_topk_prob=True,
                              # the release's routing keys (transformers' config class drops them; vLLM reads them)
                              topk_method="noaux_tc", scoring_func="sigmoid"),
}


def build_model(shape: str | dict, n_layers: int, path: Path, seed: int, logit_scale: float = 1.0) -> None:
    """Random-weight model (transformers' own init, seeded) saved as bf16 safetensors + a word-level tokenizer.
    ``shape`` names an entry of SHAPES or is such a dict (``model_type`` and config.json keys). ``logit_scale``
    multiplies ``lm_head``: peaked next-token distributions, as a trained model's are (random ones are near flat,
    so a top-1 comparison would measure ties)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    kw = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    cfg = AutoConfig.for_model(kw.pop("model_type"), num_hidden_layers=n_layers, **kw)
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # fused expert params may be left uninitialized by from_config
        for layer in model.model.layers:
            ex = getattr(layer.mlp, "experts", None)
            if ex is not None and hasattr(ex, "gate_up_proj"):
                ex.gate_up_proj.normal_(0, cfg.initializer_range)
                ex.down_proj.normal_(0, cfg.initializer_range)
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path, max_shard_size="50GB")
    # word-level over the whole vocabulary (word tN is token N), so text of random words (random_words) is random
    # tokens through quant's own calibration path (benchmarks/node.py)
    vocab = {"[UNK]": 0} | {f"t{i}": i for i in range(1, cfg.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[UNK]", eos_token="[UNK]")
    tok.save_pretrained(path)
    del model
    gc.collect()  # save_pretrained leaves reference cycles: the model's device memory goes only with them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def disk_shapes(model_type: str, config: dict) -> dict[str, list[int]]:
    """On-disk tensor name -> shape of a ``model_type`` model with these config.json keys, in the per-expert
    layout checkpoints use (``mlp.experts.<e>.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.<e>.w1``):
    what the model folder check (``models.expected``) expects. The model is built on the meta device, so a 671 B
    architecture costs no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quant.models.expected import implied_tensors
    from quant.models.families import family_for

    cfg = AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    implied, _ = implied_tensors(model, family_for(cfg.model_type))
    return {key: list(shape) for key, (shape, _) in implied.items()}


def write_shapes_only(shape: str, n_layers: int, path: Path) -> Path:
    """config.json and a header-only model.safetensors (names, dtypes, shapes; no data) of a ``shape`` model with
    ``n_layers`` layers, in the per-expert on-disk layout save_pretrained writes (``disk_shapes``): what ``quant
    estimate`` reads."""
    import struct

    from transformers import AutoConfig

    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, num_hidden_layers=n_layers, **kw)
    shapes = disk_shapes(model_type, dict(kw, num_hidden_layers=n_layers))
    header, offset = {}, 0
    for key, shp in sorted(shapes.items()):
        n = 2 * int(torch.Size(shp).numel())
        header[key] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [offset, offset + n]}
        offset += n
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    blob = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    return path


class TiledSource(ModelSource):
    """An N-layer view of a K-layer checkpoint: layer i's tensors are read from saved layer i mod K."""

    def __init__(self, path: Path, n_virtual: int):
        super().__init__(path)
        self.n_saved = int(self.config_dict["num_hidden_layers"])
        self.n_virtual = n_virtual
        self.config_dict["num_hidden_layers"] = n_virtual
        self.config.num_hidden_layers = n_virtual
        real = dict(self.weight_map)
        self.weight_map = {}
        for key, file in real.items():
            parts = key.split(".")
            if key.startswith("model.layers."):
                for i in range(int(parts[2]), n_virtual, self.n_saved):
                    self.weight_map[".".join(parts[:2] + [str(i)] + parts[3:])] = file
            else:
                self.weight_map[key] = file

    def _real(self, key: str) -> str:
        parts = key.split(".")
        if key.startswith("model.layers."):
            parts[2] = str(int(parts[2]) % self.n_saved)
        return ".".join(parts)

    def read_tensors(self, keys, device="cpu", into=None):
        real = {k: self._real(k) for k in keys}
        loaded = super().read_tensors(sorted(set(real.values())), device, into)
        return {k: loaded[r] for k, r in real.items()}

    def shapes(self):
        real = super().shapes()
        return {k: real[self._real(k)] for k in self.weight_map}

    def dtypes(self):
        real = super().dtypes()
        return {k: real[self._real(k)] for k in self.weight_map}


def random_words(n_tokens: int, vocab: int, seed: int) -> str:
    """Text of ``n_tokens`` seeded random words of build_model's tokenizer (never [UNK])."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{i}" for i in torch.randint(1, vocab, (n_tokens,), generator=g).tolist())
