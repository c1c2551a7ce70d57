"""benchmarks/records.py: every record of benchmarks/records/ is of the schema (a bad one is one error naming its file
and key), and BENCHMARKS.md's generated section is what the records render, so a hand-edited table or a record added
without rendering fails here and in ``python benchmarks/records.py check``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.records import (
    BEGIN,
    BENCHMARKS_MD,
    END,
    RECORDS_DIR,
    RecordError,
    load_record,
    load_records,
    parse_record,
    render_section,
)
from tests.conftest import REPO

GOOD = {"schema_version": 1, "date": "2026-12-01", "title": "a layer, GPTQ", "hardware": "1× H200 (143 GB)",
        "commit": "0480bed", "command": "bash benchmarks/device.sh dsv3", "compared_with": "{gptq.s_per_layer} s target",
        "setup": {"shape": "deepseek-v3", "layers": 1}, "values": {"gptq": {"s_per_layer": 19.76, "peak_gb": 54.1}},
        "current": [{"measure": "{setup.shape}: **{gptq.s_per_layer} s**", "result": "{gptq.peak_gb:.0f} GB"}],
        "rates": {"load_bytes_per_s": 2.0e9}}
NAME = "2026-12-01-a-layer"


def _with(**changes) -> dict:
    data = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


def test_every_record_is_of_the_schema():
    records = load_records()
    assert len(records) == len(list(RECORDS_DIR.glob("*.json"))) and records
    assert [r.date for r in records] == sorted((r.date for r in records), reverse=True)
    assert any(r.current for r in records) and any(r.rates for r in records)
    good = parse_record(NAME, GOOD)
    assert good.fill(good.current[0].measure) == "deepseek-v3: **19.76 s**" and good.number("gptq.peak_gb") == 54.1


@pytest.mark.parametrize("changes, message", [
    ({"commit": None}, "missing 'commit'"),
    ({"comit": "0480bed"}, "unknown key 'comit'"),
    ({"title": 3}, "'title' is int, not a string"),
    ({"hardware": " "}, "'hardware' is empty"),
    ({"schema_version": 2}, "schema_version 2"),
    ({"date": "2026-12-1"}, "must be YYYY-MM-DD"),
    ({"date": "2026-12-02"}, "begin the file's name"),
    ({"commit": "HEAD"}, "not a commit hash"),
    ({"commit_kind": "maybe"}, "commit_kind 'maybe'"),
    ({"command": []}, "'command' must be"),
    ({"values": {}}, "'values' is empty"),
    ({"values": {"wall": 3.0}}, r"values\.wall has no unit"),
    ({"values": {"gptq": {"peak": [1, 2]}}}, r"values\.gptq\.peak has no unit"),
    ({"rates": {"load_bytes_per_s": 0}}, r"rates\.load_bytes_per_s is not a positive number"),
    ({"current": [{"measure": "{gptq.s} s", "result": "x"}]}, "no value at 'gptq.s'"),
    ({"current": [{"measure": "{gptq.peak_gb:,d} GB", "result": "x"}]}, "cannot format 54.1"),
    ({"current": [{"measure": "x"}]}, r"current\[0\] must hold exactly 'measure' and 'result'"),
    ({"compared_with": "{setup.gpus}"}, "no value at 'setup.gpus'"),
])
def test_a_bad_record_is_one_error_naming_its_file_and_key(changes, message, tmp_path):
    (tmp_path / f"{NAME}.json").write_text(json.dumps(_with(**changes)))
    with pytest.raises(RecordError, match=message) as e:
        load_record(NAME, tmp_path)
    assert str(e.value).startswith(f"{NAME}.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [("{", "not JSON"), ('{"values": {"wall_s": NaN}}', "NaN is not a measurement"),
                                           ("[]", "a JSON object, not list")])
def test_a_record_that_is_not_a_json_object_of_numbers_is_refused(text, message, tmp_path):
    (tmp_path / f"{NAME}.json").write_text(text)
    with pytest.raises(RecordError, match=message):
        load_record(NAME, tmp_path)


def test_benchmarks_md_holds_what_the_records_render():
    """Every record is in the section (a current row, else a row of the older measurements), linked by its file."""
    text = BENCHMARKS_MD.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    section = text[text.index(BEGIN):text.index(END) + len(END)]
    records = load_records()
    assert section == render_section(records), "run `python benchmarks/records.py render`"
    assert all(f"(benchmarks/records/{r.name}.json)" in section for r in records)
    assert "(previous run)" not in section


def _cli(action: str, md: Path, records: Path) -> tuple[int, list[str]]:
    p = subprocess.run([sys.executable, "benchmarks/records.py", action, "--file", str(md), "--records", str(records)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    return p.returncode, [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]


def test_check_fails_on_a_hand_edit_or_an_unrendered_record_and_render_repairs_it(tmp_path):
    md, records = tmp_path / "BENCHMARKS.md", tmp_path / "records"
    shutil.copy(BENCHMARKS_MD, md)
    shutil.copytree(RECORDS_DIR, records)
    assert _cli("check", md, records) == (0, [])
    original = md.read_text()
    md.write_text(original.replace("**15.8 s** for the layer", "**14.8 s** for the layer", 1))
    assert md.read_text() != original
    code, errors = _cli("check", md, records)
    assert code == 1 and len(errors) == 1 and "generated section differs" in errors[0], errors
    assert _cli("render", md, records)[0] == 0 and md.read_text() == original
    (records / f"{NAME}.json").write_text(json.dumps(GOOD))  # a record added without rendering
    assert _cli("check", md, records)[0] == 1
    assert _cli("render", md, records)[0] == 0 and "deepseek-v3: **19.76 s**" in md.read_text()
    assert _cli("check", md, records) == (0, [])
    (records / f"{NAME}.json").write_text(json.dumps(_with(values={"wall": 1.0})))
    code, errors = _cli("check", md, records)
    assert code == 1 and len(errors) == 1 and f"{NAME}.json: values.wall has no unit" in errors[0], errors


def test_a_benchmarks_md_without_its_markers_is_one_error(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    code, errors = _cli("check", md, RECORDS_DIR)
    assert code == 1 and len(errors) == 1 and "no generated section" in errors[0], errors
