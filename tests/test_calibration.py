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


def _big_text(path: Path, head: bytes, size: int) -> None:
    """``head`` at the start of a ``size``-byte file whose rest is a hole (NUL bytes, valid UTF-8, no disk)."""
    path.write_bytes(head)
    with open(path, "r+b") as f:
        f.truncate(size)


BOUNDED = ("import resource, sys\n"
           "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
           "from quant.calibration import build_calibration\n"
           "from quant.models import resolve_model\n"
           "c = build_calibration(sys.argv[1], resolve_model('builtin:qwen3-moe-tiny').tokenizer(), 4, 64, 0)\n"
           "print(c.tokens.shape[0], max(int(i.split(':')[1]) for i in c.sample_ids))\n")


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_300_mb_source_is_read_only_as_far_as_its_windows_need(tmp_path, quant_cache, kind):
    """Before: the whole file went to the tokenizer at once, which aborted the process (exit 134, the stage left
    `running`). Now a source reads ``read_budget_bytes`` (1 MiB for these 4 windows), cut after a line, in bounded
    memory and time."""
    import subprocess
    import sys

    prose = (REPO / "calibration" / "data" / "licenses-prose.txt").read_bytes()
    head = prose * 16 if kind == "text" else b"".join(json.dumps({"text": line}).encode() + b"\n"
                                                       for line in prose.decode().splitlines() * 16)
    _big_text(tmp_path / f"big.{kind}", head, 300 << 20)
    manifest = _manifest(tmp_path, f"  - {{name: big, kind: {kind}, path: big.{kind}}}\n")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", BOUNDED, manifest], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, last_start = map(int, proc.stdout.split())
    assert rows == 4 and last_start < 1 << 20  # token offsets: all within the first MiB read
    assert time.perf_counter() - t0 < 240


def test_long_text_is_tokenized_in_pieces_cut_after_newlines_as_if_whole(tokenizer):
    from quant.calibration import tokenize

    text = (REPO / "calibration" / "data" / "python-stdlib-code.txt").read_text()[:60000]
    whole = tokenize(tokenizer, text, max_chars=len(text))
    assert tokenize(tokenizer, text, max_chars=4096).tolist() == whole.tolist()


def test_a_source_cut_inside_a_character_or_a_line_reads_up_to_it(tmp_path):
    from quant.calibration import Source, _documents

    text = ("é" * 600_000).encode()  # 1.2 MB: the 1 MiB cut falls between the two bytes of a character
    (tmp_path / "t.txt").write_bytes(text)
    (docs,) = _documents(Source(name="t", path="t.txt"), tmp_path, 1 << 20)
    assert docs == "é" * ((1 << 20) // 2)
    (tmp_path / "t.jsonl").write_bytes(b"".join(json.dumps({"text": f"row {i}"}).encode() + b"\n"
                                                for i in range(100_000)))
    docs = _documents(Source(name="t", kind="jsonl", path="t.jsonl"), tmp_path, 100_000)
    assert docs == [f"row {i}" for i in range(len(docs))] and 0 < len(docs) < 100_000
