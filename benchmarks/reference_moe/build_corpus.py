"""Build the training corpus, tokenizer and token files for the reference MoE (``builtin:reference-moe``).

Sources, all read from this machine (no network), one document per file:

* **code**: the CPython standard library (``sysconfig.get_paths()['stdlib']``, ``*.py``) without test
  directories, ``idlelib``, ``lib2to3`` test data, ``site-packages``, the machine-specific
  ``_sysconfigdata*`` / ``config-*`` files and the charmap tables that ``gencodec.py`` generated
  (``encodings/cp1252.py`` and friends: 4 MB of hex tables that would dominate the code and the BPE merges);
* **prose**: the license texts in ``/usr/share/common-licenses`` (verbatim copying permitted) and the
  ``*.md`` / ``*.rst`` / ``*.txt`` documentation (also ``.gz``-compressed) of the Debian packages in
  ``DOC_PACKAGES`` below, whose licenses are permissive (checked against each package's ``copyright`` file at
  build time). Copyleft-licensed docs (git, dpkg, util-linux, ...) and Node.js's changelogs (commit-hash lists)
  are left out.

Split: documents go to ``heldout`` when ``sha256(f"{seed}:{path}")`` falls under ``--heldout-fraction`` (per
domain, with a minimum count per domain), plus the sources of the repo's evaluation texts
(``calibration/data/heldout-*.txt``: Apache-2.0, Artistic, BSD licenses and CPython's glob.py / string.py),
plus any document that shares several long lines with those texts. The held-out split is then divided into
``val`` (periodic evaluation during training) and ``test`` (the final numbers; holds the repo's held-out texts).
Calibration texts (``calibration/data/*.txt`` other than ``heldout-*``) may land in train.

Outputs (``--out``, default ``.refmoe/corpus``): ``tokenizer/`` (a ``PreTrainedTokenizerFast`` folder; byte-level
BPE trained on the train split only), ``train.bin`` / ``val.bin`` / ``test.bin`` (uint16 token streams, every
document followed by ``<|endoftext|>``), ``val.jsonl`` / ``test.jsonl`` (the held-out documents' text, for
next-line evaluation) and ``corpus.json`` (every document with its source, license, split, size, sha256;
excluded files with the reason; token counts; sha256 of every output).

    python benchmarks/reference_moe/build_corpus.py --out .refmoe/corpus

``--calibration-manifest DIR`` writes instead the servable study's calibration set (``benchmarks/study_servable.py``):
license prose and stdlib code as the JSONL sources of a calibration manifest, ``DIR/manifest.yaml``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
REPO = Path(__file__).resolve().parents[2]
LICENSES_DIR = Path("/usr/share/common-licenses")
DOC_DIR = Path("/usr/share/doc")
DOC_SUFFIXES = (".md", ".rst", ".txt")

# Debian package -> (license of its documentation, a string its copyright file must contain).
DOC_PACKAGES: dict[str, tuple[str, str]] = {
    "nodejs": ("MIT", "Permission is hereby granted, free of charge"),
    "python3-pip": ("MIT", "License: Expat"),
    "python3-setuptools": ("MIT", "Permission is hereby granted"),
    "python3-yaml": ("MIT", "Permission is hereby granted"),
    "python3-jwt": ("MIT", "License: Expat"),
    "python3-httplib2": ("MIT", "License: Expat"),
    "python3-oauthlib": ("BSD-3-Clause", "License: BSD-3-clause"),
    "openssl": ("Apache-2.0", "License: Apache-2.0"),
    "libxml2": ("MIT", "License: MIT-1"),
    "libffi8": ("MIT", "License: Expat"),
    "libnghttp2-14": ("MIT", "License: Expat"),
    "libjansson4": ("MIT", "License: Expat"),
    "libcbor0.8": ("MIT", "License: Expat"),
    "libjs-underscore": ("MIT", "License: Expat"),
    "pkgconf-bin": ("ISC", "License: ISC"),
    "libcommons-cli-java": ("Apache-2.0", "License: Apache-2.0"),
    "yq": ("Apache-2.0", "License: Apache"),
    "zstd": ("BSD-3-Clause OR GPL-2.0", "License: BSD-3-clause or GPL-2"),
    "libpng16-16": ("libpng-2.0", "License: libpng"),
    "libjpeg62-turbo-dev": ("IJG AND BSD-3-Clause", "License: BSD-BY-LC-NE"),
    "libxdmcp-dev": ("MIT (X11)", "Permission to use, copy, modify, distribute, and sell"),
    "libxrender-dev": ("MIT (X11)", "Permission to use, copy, modify, distribute, and sell"),
}
# Within allowed packages: files that are not prose (data, fingerprints, dependency pins, commit-hash lists).
DOC_SKIP_PARTS = ("/changelogs/", "CHANGELOG", "fingerprints.txt", "requirements.txt", "/examples/")
# Held-out evaluation texts of the repo and the documents they were cut from (verified by line overlap).
REPO_HELDOUT_FILES = ("calibration/data/heldout-apache-artistic-bsd.txt", "calibration/data/heldout-python-code.txt")
FORCED_HELDOUT = ("licenses/Apache-2.0", "licenses/Artistic", "licenses/BSD", "stdlib/glob.py", "stdlib/string.py")
MIN_LINE_CHARS = 40  # lines at least this long (stripped) count for the overlap check
MAX_SHARED_LINES = 3  # a train candidate sharing more long lines with the repo's held-out texts moves out
MAX_DOC_BYTES = 1_000_000


@dataclass
class Doc:
    path: str  # stable name: stdlib/..., licenses/..., doc/<package>/...
    domain: str  # code | prose
    source: str
    license: str
    text: str
    split: str = "train"
    reason: str = ""  # why it is in its split when not by hash
    sha256: str = ""
    n_chars: int = 0
    n_tokens: int = 0


def _read_text(path: Path) -> str | None:
    """UTF-8 plain text or None (binary, undecodable, too large, empty)."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if not raw.strip() or len(raw) > MAX_DOC_BYTES or b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    printable = sum(ch.isprintable() or ch in "\n\t\r" for ch in text)
    return text if printable >= 0.98 * len(text) else None


def _stdlib_excluded(rel: Path, text: str) -> str:
    parts = rel.parts
    if any(p in ("test", "tests", "idle_test", "site-packages", "idlelib", "__pycache__") for p in parts):
        return "test/idlelib/site-packages"
    if parts[0].startswith("config-") or rel.name.startswith("_sysconfigdata"):
        return "machine-specific build data"
    if parts[0] == "lib2to3" and "tests" in parts:
        return "lib2to3 test data"
    if parts[0] == "encodings" and "gencodec.py" in text:
        return "generated charmap table"
    return ""


def collect_stdlib(excluded: list[dict]) -> list[Doc]:
    root = Path(sysconfig.get_paths()["stdlib"])
    version = f"CPython {sys.version.split()[0]}"
    docs = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        text = _read_text(path) if path.is_file() else None
        why = _stdlib_excluded(rel, text or "")
        if text is None and not why:
            why = "empty" if path.is_file() and not path.read_bytes().strip() else "not UTF-8 plain text"
        if why:
            if not any(p in ("test", "tests", "site-packages", "idlelib", "__pycache__") for p in rel.parts):
                excluded.append({"path": f"stdlib/{rel.as_posix()}", "reason": why})
            continue
        docs.append(Doc(f"stdlib/{rel.as_posix()}", "code", version, "PSF-2.0", text))
    return docs


def collect_licenses(excluded: list[dict]) -> list[Doc]:
    docs = []
    for path in sorted(LICENSES_DIR.iterdir()):
        if path.is_symlink():  # GPL -> GPL-3 etc.: the target is collected under its own name
            excluded.append({"path": f"licenses/{path.name}", "reason": f"symlink to {os.readlink(path)}"})
            continue
        text = _read_text(path)
        if text is not None:
            docs.append(Doc(f"licenses/{path.name}", "prose", "Debian /usr/share/common-licenses",
                            "verbatim copying permitted (license text)", text))
    return docs


def _doc_files(pkg_dir: Path) -> list[Path]:
    out = []
    for path in pkg_dir.rglob("*"):
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        if path.is_file() and not path.is_symlink() and name.endswith(DOC_SUFFIXES):
            out.append(path)
    return sorted(out, key=lambda p: p.relative_to(pkg_dir).as_posix())


def collect_docs(excluded: list[dict]) -> list[Doc]:
    docs = []
    for pkg, (license_id, marker) in sorted(DOC_PACKAGES.items()):
        pkg_dir = DOC_DIR / pkg
        copyright_file = pkg_dir / "copyright"
        if not copyright_file.is_file():
            print(f"note: /usr/share/doc/{pkg} missing; skipped", file=sys.stderr)
            continue
        if marker not in copyright_file.read_text(errors="replace"):
            excluded.append({"path": f"doc/{pkg}", "reason": f"copyright file lacks {marker!r}"})
            continue
        for path in _doc_files(pkg_dir):
            rel = f"doc/{pkg}/{path.relative_to(pkg_dir).as_posix()}"
            if any(part in "/" + rel for part in DOC_SKIP_PARTS):
                excluded.append({"path": rel, "reason": "not prose (changelog/data/examples)"})
                continue
            text = _read_text(path)
            if text is None:
                excluded.append({"path": rel, "reason": "not UTF-8 plain text or too large"})
                continue
            docs.append(Doc(rel, "prose", f"Debian package {pkg}", license_id, text))
    return docs


def dedupe(docs: list[Doc], excluded: list[dict]) -> list[Doc]:
    seen: dict[str, str] = {}
    out = []
    for d in docs:
        d.sha256 = hashlib.sha256(d.text.encode()).hexdigest()
        d.n_chars = len(d.text)
        if d.sha256 in seen:
            excluded.append({"path": d.path, "reason": f"duplicate of {seen[d.sha256]}"})
            continue
        seen[d.sha256] = d.path
        out.append(d)
    return out


def _long_lines(text: str) -> set[str]:
    return {ln.strip() for ln in text.splitlines() if len(ln.strip()) >= MIN_LINE_CHARS}


def _hash_fraction(seed: int, path: str) -> float:
    return int(hashlib.sha256(f"{seed}:{path}".encode()).hexdigest()[:12], 16) / 16**12


def assign_splits(docs: list[Doc], seed: int, fraction: float, min_per_domain: int) -> None:
    """Hash split per domain (+ minimum count), forced held-out documents, overlap moves; then val/test."""
    protected = set().union(*(_long_lines((REPO / f).read_text()) for f in REPO_HELDOUT_FILES))
    for d in docs:
        if d.path in FORCED_HELDOUT:
            d.split, d.reason = "test", "source of calibration/data/heldout-*.txt"
        elif len(_long_lines(d.text) & protected) > MAX_SHARED_LINES:
            d.split, d.reason = "test", "shares lines with calibration/data/heldout-*.txt"
    for domain in ("code", "prose"):
        pool = sorted((d for d in docs if d.domain == domain and d.split == "train"),
                      key=lambda d: _hash_fraction(seed, d.path))
        n_by_hash = sum(_hash_fraction(seed, d.path) < fraction for d in pool)
        for i, d in enumerate(pool[:max(n_by_hash, min_per_domain)]):
            # alternate val / test so both carry code and prose
            d.split = "val" if i % 2 == 0 else "test"
            d.reason = "hash" if i < n_by_hash else "hash (domain minimum)"
    missing = [p for p in FORCED_HELDOUT if p not in {d.path for d in docs if d.split == "test"}]
    if missing:
        raise SystemExit(f"error: held-out evaluation sources not found on this machine: {missing}")


def overlap_report(docs: list[Doc]) -> dict:
    """How many long lines of each repo held-out text appear in train documents (should be ~0)."""
    train_lines = set().union(*(_long_lines(d.text) for d in docs if d.split == "train"))
    report = {}
    for f in REPO_HELDOUT_FILES:
        lines = _long_lines((REPO / f).read_text())
        shared = sorted(lines & train_lines)
        report[f] = {"long_lines": len(lines), "in_train": len(shared), "examples": shared[:5]}
    return report


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer, as quant's builtin tiny tokenizer) with one special token, EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def save_hf_tokenizer(tok, out: Path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS,
                                 model_max_length=1024)
    hf.save_pretrained(out)
    return hf


def tokenize_split(hf, docs: list[Doc], path: Path) -> int:
    """Write the split as one uint16 stream, each document followed by EOS; fills Doc.n_tokens."""
    eos_id = hf.convert_tokens_to_ids(EOS)
    encs = hf.backend_tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    ids = []
    for d, enc in zip(docs, encs, strict=True):
        d.n_tokens = len(enc.ids)
        ids.extend(enc.ids)
        ids.append(eos_id)
    arr = np.asarray(ids, dtype=np.uint16)
    assert int(arr.max(initial=0)) < 2**16
    arr.tofile(path)
    return len(arr)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_outputs(docs: list[Doc], excluded: list[dict], args, out: Path) -> dict:
    by_split = {s: [d for d in docs if d.split == s] for s in ("train", "val", "test")}
    tok = train_tokenizer([d.text for d in by_split["train"]], args.vocab_size)
    hf = save_hf_tokenizer(tok, out / "tokenizer")
    tokens = {s: tokenize_split(hf, ds, out / f"{s}.bin") for s, ds in by_split.items()}
    for s in ("val", "test"):
        with open(out / f"{s}.jsonl", "w") as f:
            for d in by_split[s]:
                f.write(json.dumps({"path": d.path, "domain": d.domain, "text": d.text}) + "\n")
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "corpus.json")
    summary = {
        "schema_version": 1,
        "built_with": {"python": sys.version.split()[0], "tokenizers": __import__("tokenizers").__version__,
                       "numpy": np.__version__, "argv": sys.argv[1:]},
        "params": {"seed": args.seed, "heldout_fraction": args.heldout_fraction, "vocab_size": args.vocab_size,
                   "min_heldout_per_domain": args.min_heldout_per_domain},
        "eos_token": EOS, "eos_id": hf.convert_tokens_to_ids(EOS), "vocab_size": len(hf),
        "tokens": tokens,
        "documents_per_split": {s: len(ds) for s, ds in by_split.items()},
        "by_domain": {f"{s}/{dom}": {"docs": sum(d.domain == dom for d in ds),
                                     "chars": sum(d.n_chars for d in ds if d.domain == dom),
                                     "tokens": sum(d.n_tokens for d in ds if d.domain == dom)}
                      for s, ds in by_split.items() for dom in ("code", "prose")},
        "heldout_overlap": overlap_report(docs),
        "files": {p.relative_to(out).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256_file(p)}
                  for p in files},
        "documents": [{k: v for k, v in asdict(d).items() if k != "text"} for d in docs],
        "excluded": excluded,
    }
    (out / "corpus.json").write_text(json.dumps(summary, indent=1))
    return summary


STUDY_PROSE_SHARE = 0.4  # license prose; at 16x (52 k tokens) it stays within the ~57 k tokens the licenses hold
STUDY_CODE_CHARS = 1_500_000  # ~400 k tokens of stdlib code, 5x what the study's 16x set draws


def write_calibration_manifest(out: Path) -> Path:
    """License prose and CPython stdlib code, as calibration/bundled.yaml but larger: the texts this corpus collects
    (Debian's /usr/share/common-licenses, this Python's stdlib) without the held-out evaluation sources and anything
    sharing lines with them; all licenses and the first STUDY_CODE_CHARS characters of code in hash order, as the
    JSONL sources of a calibration manifest. Returns the manifest's path."""
    import yaml

    excluded: list[dict] = []
    docs = dedupe(collect_stdlib(excluded) + collect_licenses(excluded), excluded)
    assign_splits(docs, seed=0, fraction=0.03, min_per_domain=8)  # marks what shares lines with held-out text
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for domain, prefix, weight in (("prose", "licenses/", STUDY_PROSE_SHARE), ("code", "stdlib/", 1 - STUDY_PROSE_SHARE)):
        pool = sorted((d for d in docs if d.path.startswith(prefix) and d.path not in FORCED_HELDOUT
                       and "shares lines" not in d.reason),
                      key=lambda d: hashlib.sha256(d.path.encode()).hexdigest())
        kept, chars = [], 0
        for d in pool:
            if chars >= STUDY_CODE_CHARS:
                break
            kept.append(json.dumps({"text": d.text, "path": d.path}))
            chars += len(d.text)
        (out / f"{domain}.jsonl").write_text("\n".join(kept) + "\n")
        sources.append({"name": domain, "kind": "jsonl", "path": f"{domain}.jsonl", "weight": weight})
    manifest = {"name": "licenses-stdlib", "description": "license prose + stdlib code (study)",
                "sources": sources}
    (out / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return out / "manifest.yaml"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".refmoe" / "corpus")
    ap.add_argument("--calibration-manifest", type=Path, default=None, metavar="DIR",
                    help="write the servable study's calibration manifest into DIR instead of the corpus")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--heldout-fraction", type=float, default=0.03, help="per domain, split evenly into val/test")
    ap.add_argument("--min-heldout-per-domain", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.calibration_manifest is not None:
        print(write_calibration_manifest(args.calibration_manifest))
        return
    t0 = time.time()
    excluded: list[dict] = []
    docs = dedupe(collect_stdlib(excluded) + collect_licenses(excluded) + collect_docs(excluded), excluded)
    assign_splits(docs, args.seed, args.heldout_fraction, args.min_heldout_per_domain)
    args.out.mkdir(parents=True, exist_ok=True)
    s = write_outputs(docs, excluded, args, args.out)
    for key, v in s["by_domain"].items():
        print(f"{key:12s} docs {v['docs']:5d}  chars {v['chars']:10,d}  tokens {v['tokens']:10,d}")
    print("tokens (with one EOS per document): " + ", ".join(f"{k} {v:,d}" for k, v in s["tokens"].items()))
    chars = sum(v["chars"] for v in s["by_domain"].values())
    overlap = {k: v["in_train"] for k, v in s["heldout_overlap"].items()}
    print(f"chars/token {chars / sum(s['tokens'].values()):.2f}; vocab {s['vocab_size']}; excluded {len(excluded)} "
          f"files; long lines of the repo's held-out texts found in train: {json.dumps(overlap)}")
    total = sum(f["bytes"] for f in s["files"].values()) + (args.out / "corpus.json").stat().st_size
    print(f"wrote {args.out} ({total / 2**20:.1f} MiB) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
