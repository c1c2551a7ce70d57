"""Builtin models are quant's own files: the same bytes under any transformers version."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from quant.errors import ModelError
from quant.models import resolve_model
from quant.models.builtin import builtin_path, seeded_tensor
from tests.conftest import REPO

# builtin:qwen3-moe-tiny's fingerprint (config.json and every shard's SHA-256): a run directory made with one
# environment opens in another. Changes only with BUILTIN_VERSION (then update it here).
QWEN3_TINY_FINGERPRINT = "d8baed0f36479dd7"


def test_builtin_files_do_not_depend_on_the_transformers_version(tmp_path, monkeypatch):
    import transformers

    a = builtin_path("mixtral-tiny")
    monkeypatch.setenv("QUANT_CACHE", str(tmp_path))
    monkeypatch.setattr(transformers, "__version__", "9.99.0")
    b = builtin_path("mixtral-tiny")
    assert a.name == b.name and a != b
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert "transformers_version" not in json.loads((b / "config.json").read_text())


def test_builtin_weights_are_drawn_by_tensor_name_and_shape():
    path = builtin_path("qwen3-moe-tiny")
    w = load_file(str(path / "model.safetensors"))
    key = "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(w[key], seeded_tensor("qwen3-moe-tiny", key, tuple(w[key].shape)).to(torch.bfloat16))
    assert torch.equal(w["model.norm.weight"], torch.ones_like(w["model.norm.weight"]))
    assert not torch.equal(w["model.layers.0.mlp.experts.0.up_proj.weight"], w["model.layers.0.mlp.experts.1.up_proj.weight"])
    assert resolve_model("builtin:qwen3-moe-tiny").fingerprint == QWEN3_TINY_FINGERPRINT


def _tree_size() -> int:
    import subprocess

    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / os.fsdecode(f)).stat().st_size for f in files if f and (REPO / os.fsdecode(f)).is_file())


def test_the_reference_weights_come_from_the_repositorys_history_not_its_tree(tmp_path):
    """builtin:reference-moe's 43 MB of shards are read from a commit main reaches, each file checked against the
    pinned digests: the work tree (what a GPU host is sent with every command) and the wheel stay small."""
    from quant.models import builtin

    assert not list((REPO / "quant").rglob("*.safetensors*"))
    builtin._fetch_shipped("reference-moe", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(builtin._digests("reference-moe"))
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) > 40e6 > _tree_size() * 4


def test_shipped_files_from_a_folder_are_checked_against_the_pinned_digests(tmp_path, monkeypatch):
    """Where quant has no git history (a wheel, a GPU host the files were carried to), ``QUANT_ASSETS`` names a
    folder with them; a damaged or other copy is refused, and with neither the error says where to get them."""
    from quant.models import builtin

    folder = tmp_path / "assets"
    (folder / "reference-moe").mkdir(parents=True)
    builtin._fetch_shipped("reference-moe", folder / "reference-moe")
    monkeypatch.setattr(builtin, "REPOSITORY", tmp_path / "not-a-clone")
    monkeypatch.setenv("QUANT_ASSETS", str(folder))
    builtin._fetch_shipped("reference-moe", (tmp_path / "a").mkdir() or tmp_path / "a")
    assert (tmp_path / "a" / "config.json").read_bytes() == (folder / "reference-moe" / "config.json").read_bytes()
    with open(folder / "reference-moe" / "model-00003-of-00005.safetensors.xz", "r+b") as f:
        f.seek(1000)
        f.write(b"\0")
    with pytest.raises(ModelError, match="model-00003-of-00005.safetensors.xz does not match its pinned SHA-256"):
        builtin._fetch_shipped("reference-moe", (tmp_path / "b").mkdir() or tmp_path / "b")
    monkeypatch.delenv("QUANT_ASSETS")
    with pytest.raises(ModelError, match="not in this copy of quant: .*set QUANT_ASSETS.*git archive 314982bd3dee"):
        builtin._fetch_shipped("reference-moe", (tmp_path / "c").mkdir() or tmp_path / "c")
