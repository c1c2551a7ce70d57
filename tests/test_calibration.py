"""Calibration manifests and sources that cannot be used are one CalibrationError naming the file and place."""

import json
import time
from pathlib import Path

import pytest

from quant.calibration import build_calibration
from quant.errors import CalibrationError
from tests.conftest import REPO, run_cli


@pytest.fixture(scope="module")
def tokenizer(quant_cache):
    from quant.models import resolve_model

    return resolve_model("builtin:qwen3-moe-tiny").tokenizer()


def _manifest(tmp_path: Path, sources: str) -> str:
    p = tmp_path / "m.yaml"
    p.write_text(f"name: m\nsources:\n{sources}")
    return str(p)


def _build(dataset: str, tokenizer):
    return build_calibration(dataset, tokenizer, n_samples=2, seq_len=16, seed=0)


def test_invalid_utf8_text(tmp_path, tokenizer):
    (tmp_path / "t.txt").write_bytes(b"fine text " * 50 + b"\xff\xfe broken")
    with pytest.raises(CalibrationError, match="t.txt is not UTF-8 text \\(invalid byte at offset 500\\)"):
        _build(_manifest(tmp_path, "  - {name: t, kind: text, path: t.txt}\n"), tokenizer)


@pytest.mark.parametrize("lines,match", [
    (['{"text": "a b c"}', "{not json"], "line 2 is not JSON"),
    (['{"text": "a b c"}', '{"body": "x"}'], "line 2 has no string field 'text'"),
    (['{"text": 3}'], "line 1 has no string field 'text'"),
    (['["text"]'], "line 1 has no string field"),
])
def test_bad_jsonl(tmp_path, tokenizer, lines, match):
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CalibrationError, match=match):
        _build(_manifest(tmp_path, "  - {name: d, kind: jsonl, path: d.jsonl}\n"), tokenizer)


def test_jsonl_invalid_utf8(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(CalibrationError, match="not UTF-8"):
        _build(_manifest(tmp_path, "  - {name: d, kind: jsonl, path: d.jsonl}\n"), tokenizer)


@pytest.mark.parametrize("text,match", [
    ("name: m\nsources: []\n", "sources: .*at least 1"),
    ("name: m\n", "sources: Field required"),
    ("- a\n", "Input should be"),
    ("name: m\nsources: !!set {a}\n", "unsupported YAML tag"),
    (b"name: \xff\n", "not UTF-8"),
    ("name: m\nname: n\nsources: []\n", "duplicate key 'name'"),
    ("name: m\nsources:\n  - {name: a, path: x.txt, weight: .inf}\n", "weight: Input should be a finite number"),
    ("name: m\nsources:\n  - {name: a, path: x.txt, weight: .nan}\n", "weight: Input should be a finite number"),
    ("name: m\nsources:\n  - {name: a, path: x.txt, weight: 1.0e308}\n  - {name: b, path: x.txt, weight: 1.0e308}\n",
     "weights add up to more than a float holds"),
])
def test_bad_manifests(tmp_path, tokenizer, text, match):
    p = tmp_path / "m.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CalibrationError, match=match):
        _build(str(p), tokenizer)


def test_huge_weights_that_fit_a_float_split_samples_by_their_ratio(tmp_path, tokenizer):
    """Weights near the float maximum (their sum fits): n * w overflowed before the ratio was taken."""
    (tmp_path / "a.txt").write_text("alpha beta gamma delta " * 200)
    (tmp_path / "b.txt").write_text("one two three four five " * 200)
    dataset = _manifest(tmp_path, "  - {name: a, path: a.txt, weight: 8.0e307}\n"
                                  "  - {name: b, path: b.txt, weight: 8.0e307}\n")
    calib = build_calibration(dataset, tokenizer, n_samples=4, seq_len=16, seed=0)
    assert sorted(calib.domains) == ["a", "a", "b", "b"]


def test_hub_source_while_offline(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(CalibrationError, match="hub dataset 'acme/nope' could not be read .* network access"):
        _build(_manifest(tmp_path, "  - {name: web, kind: hub, dataset: acme/nope}\n"), tokenizer)
    assert time.perf_counter() - t0 < 60


def test_cluster_manifest_offline_is_one_cli_line(tmp_path):
    p = run_cli("calibrate", "recipes/mixed_int8_int4.yaml", "-o", str(tmp_path / "r"),
                "--set", "calibration.dataset=calibration/cluster-fineweb-edu.yaml",
                env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "HuggingFaceFW/fineweb-edu" in lines[0]
    stage = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["calibrate"]
    assert stage["status"] == "failed" and "CalibrationError" in stage["error"]


def test_bundled_manifest_still_builds(tokenizer):
    calib = _build(str(REPO / "calibration" / "bundled.yaml"), tokenizer)
    assert calib.tokens.shape == (2, 16)
