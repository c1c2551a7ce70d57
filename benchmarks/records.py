"""Measurements as data: the records in ``benchmarks/records/*.json``, checked, and BENCHMARKS.md's current figures
rendered from them.

    python benchmarks/records.py render   # rewrite BENCHMARKS.md's generated section from the records
    python benchmarks/records.py check    # exit 1 with one error line where a record is bad or the section is stale

A record is one measurement, one file named ``<date>-<what>.json``:

- ``schema_version`` (1), ``date`` (ISO), ``title`` (what was measured, one line);
- ``hardware`` ("1× H200 (143 GB), 16 CPU cores, 128 GB host"), ``software`` (optional: "torch 2.11.0+cu130, ...");
- ``commit`` (hex) and ``commit_kind`` (optional: ``ran``, the default; ``recorded`` where the record names the commit
  that wrote it down; ``after`` where the code was a later, unnamed one);
- ``command`` (the exact command line, or a list of them in the order they ran) and ``compared_with`` (what the
  figures were set against: another commit, another tool, a target);
- ``setup`` (optional: what was run, e.g. ``shape``, ``layers``, ``virtual_layers``, ``samples``, ``seq_len``) and
  ``values`` (what was measured: every number's key, or a key above it, names its unit, e.g. ``wall_s``,
  ``peak_gb``, ``k_tokens_per_s``, ``error_rel``, ``speedup_x``, ``n_passed``);
- ``current`` (optional: the rows this record gives BENCHMARKS.md's current figures, ``measure`` and ``result``,
  whose ``{path}`` fields are filled from ``values``, or from ``setup`` for ``{setup.path}``; ``{path:spec}``
  formats as ``format()`` does); ``summary`` (optional, a template as those: the figures of a record without
  current rows, shown after its title in the older measurements' table);
- ``rates`` (optional: the constants of ``quant/forecast/throughputs.py`` this measurement gives, by their names);
- ``notes`` (optional).

Standard library only: tests read the records through this module.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECORDS_DIR = REPO / "benchmarks" / "records"
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
SCHEMA_VERSION = 1
BEGIN = "<!-- generated from benchmarks/records by `python benchmarks/records.py render`: do not edit -->"
END = "<!-- end generated -->"

REQUIRED = {"schema_version": int, "date": str, "title": str, "hardware": str, "commit": str, "command": (str, list),
            "compared_with": str, "values": dict}
OPTIONAL = {"software": str, "commit_kind": str, "setup": dict, "current": list, "summary": str, "rates": dict,
            "notes": str}
COMMIT_KINDS = {"ran": "{}", "recorded": "recorded in {}", "after": "after {}"}
# words that name a unit in a key (split at "_"); counts start with "n_"
UNIT_WORDS = frozenset({"s", "ms", "us", "min", "seconds", "gb", "mb", "bytes", "x", "ratio", "rel", "fraction", "percent",
                        "bits", "ppl", "nats", "spearman"})
FIELD = re.compile(r"\{([A-Za-z0-9_.]+)(?::([^{}]*))?\}")


class RecordError(ValueError):
    """A record that cannot be read or is not of the schema, or a BENCHMARKS.md without its generated section."""


@dataclass(frozen=True)
class Row:
    """One row of the current figures: what was measured and what it was compared with (templates)."""

    measure: str
    result: str


@dataclass(frozen=True)
class Record:
    """One measurement (the module docstring gives the fields). ``setup`` and ``values`` are read-only by contract."""

    name: str
    date: str
    title: str
    hardware: str
    software: str | None
    commit: str
    commit_kind: str
    commands: tuple[str, ...]
    compared_with: str
    setup: dict[str, Any]
    values: dict[str, Any]
    current: tuple[Row, ...]
    summary: str | None
    rates: dict[str, float]
    notes: str | None

    def value(self, path: str) -> Any:
        """The value at a dotted ``path`` of ``values`` (``setup.…`` for ``setup``); list items by index."""
        parts = path.split(".")
        node: Any = self.setup if parts[0] == "setup" else self.values
        for part in parts[1:] if parts[0] == "setup" else parts:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise RecordError(f"{self.name}.json: no value at '{path}'")
        return node

    def number(self, path: str) -> float:
        v = self.value(path)
        if not _is_number(v):
            raise RecordError(f"{self.name}.json: '{path}' is {v!r}, not a number")
        return float(v)

    def fill(self, template: str) -> str:
        """``template`` with each ``{path}`` / ``{path:spec}`` replaced by the record's value, formatted."""
        def one(m: re.Match) -> str:
            v = self.value(m.group(1))
            try:
                return format(v, m.group(2) or "")
            except (TypeError, ValueError) as e:
                raise RecordError(f"{self.name}.json: {m.group(0)} cannot format {v!r}: {e}") from None
        return FIELD.sub(one, template)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _unitless(node: Any, path: tuple[str, ...]) -> list[str]:
    """Paths of numbers under ``node`` none of whose keys names a unit."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _unitless(v, (*path, str(k)))]
    if isinstance(node, list):
        return [p for v in node for p in _unitless(v, path)]
    named = any(k.startswith("n_") or UNIT_WORDS & set(k.split("_")) for k in path)
    return [] if named or not _is_number(node) else [".".join(path)]


def _check_fields(name: str, data: Any) -> None:
    if not isinstance(data, dict):
        raise RecordError(f"{name}.json: a record is a JSON object, not {type(data).__name__}")
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise RecordError(f"{name}.json: unknown key '{unknown[0]}' (known: {', '.join([*REQUIRED, *OPTIONAL])})")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise RecordError(f"{name}.json: missing '{missing[0]}' (a record needs {', '.join(REQUIRED)})")
    for key, kind in {**REQUIRED, **OPTIONAL}.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            raise RecordError(f"{name}.json: '{key}' is {type(data[key]).__name__}, not {_kind_name(kind)}")
        if isinstance(data.get(key), str) and not data[key].strip():
            raise RecordError(f"{name}.json: '{key}' is empty")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", list: "a list", dict: "an object"}
    return " or ".join(names[k] for k in (kind if isinstance(kind, tuple) else (kind,)))


def _check_identity(name: str, data: dict) -> None:
    if data["schema_version"] != SCHEMA_VERSION:
        raise RecordError(f"{name}.json: schema_version {data['schema_version']}, this reader knows {SCHEMA_VERSION}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]) or not name.startswith(data["date"] + "-"):
        raise RecordError(f"{name}.json: date '{data['date']}' must be YYYY-MM-DD and begin the file's name")
    if not re.fullmatch(r"[0-9a-f]{7,40}", data["commit"]):
        raise RecordError(f"{name}.json: commit '{data['commit']}' is not a commit hash (7 to 40 hex digits)")
    if data.get("commit_kind", "ran") not in COMMIT_KINDS:
        raise RecordError(f"{name}.json: commit_kind '{data['commit_kind']}' is not one of {', '.join(COMMIT_KINDS)}")
    commands = [data["command"]] if isinstance(data["command"], str) else data["command"]
    if not commands or not all(isinstance(c, str) and c.strip() for c in commands):
        raise RecordError(f"{name}.json: 'command' must be a command line or a non-empty list of them")


def _check_measures(name: str, data: dict) -> None:
    if not data["values"]:
        raise RecordError(f"{name}.json: 'values' is empty: a record holds what was measured")
    if "setup" in data["values"]:
        raise RecordError(f"{name}.json: 'values.setup' would shadow the record's setup in templates")
    unitless = _unitless(data["values"], ())
    if unitless:
        raise RecordError(f"{name}.json: values.{unitless[0]} has no unit in its key (a word of "
                          f"{', '.join(sorted(UNIT_WORDS))}, or n_ for a count)")
    bad = [k for k, v in data.get("rates", {}).items() if not _is_number(v) or v <= 0]
    if bad:
        raise RecordError(f"{name}.json: rates.{bad[0]} is not a positive number")
    for i, row in enumerate(data.get("current", [])):
        if not isinstance(row, dict) or set(row) != {"measure", "result"} or not all(
                isinstance(v, str) and v.strip() for v in row.values()):
            raise RecordError(f"{name}.json: current[{i}] must hold exactly 'measure' and 'result', non-empty strings")


def parse_record(name: str, data: Any) -> Record:
    """The record ``name`` (its file's stem) from its parsed JSON, or a RecordError naming the file and the key."""
    _check_fields(name, data)
    _check_identity(name, data)
    _check_measures(name, data)
    record = Record(
        name=name, date=data["date"], title=data["title"], hardware=data["hardware"], software=data.get("software"),
        commit=data["commit"], commit_kind=data.get("commit_kind", "ran"),
        commands=(data["command"],) if isinstance(data["command"], str) else tuple(data["command"]),
        compared_with=data["compared_with"], setup=data.get("setup", {}), values=data["values"],
        current=tuple(Row(r["measure"], r["result"]) for r in data.get("current", [])), summary=data.get("summary"),
        rates={k: float(v) for k, v in data.get("rates", {}).items()}, notes=data.get("notes"))
    rows = [text for row in record.current for text in (row.measure, row.result)]
    for template in [record.compared_with, record.summary or "", *rows]:
        record.fill(template)  # every field resolves and formats
    return record


def _reject_constant(token: str) -> None:
    raise RecordError(f"{token} is not a measurement (JSON has no NaN or infinity)")


def load_record(name: str, directory: Path = RECORDS_DIR) -> Record:
    """The record in ``directory / f"{name}.json"``."""
    path = Path(directory) / f"{name}.json"
    try:
        data = json.loads(path.read_text(), parse_constant=_reject_constant)
    except OSError as e:
        raise RecordError(f"{name}.json: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{name}.json: not JSON ({e.msg}, line {e.lineno})") from None
    except RecordError as e:
        raise RecordError(f"{name}.json: {e}") from None
    return parse_record(name, data)


def load_records(directory: Path = RECORDS_DIR) -> list[Record]:
    """Every record of ``directory``, newest first (then by name)."""
    records = [load_record(p.stem, directory) for p in sorted(Path(directory).glob("*.json"))]
    if not records:
        raise RecordError(f"{directory}: no records (*.json)")
    return sorted(records, key=lambda r: (_negated(r.date), r.name))


def _negated(date: str) -> tuple[int, ...]:
    return tuple(-int(p) for p in date.split("-"))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _columns(record: Record) -> list[str]:
    """hardware, date (linking the record), commit, command: the columns every table shares."""
    commands = "; ".join(f"`{c}`" for c in record.commands)
    return [record.hardware, f"[{record.date}](benchmarks/records/{record.name}.json)",
            COMMIT_KINDS[record.commit_kind].format(record.commit), commands]


def render_current(records: list[Record]) -> list[str]:
    """The current figures: one row per ``current`` entry, newest record first."""
    lines = ["| measure | hardware | date (record) | commit | command | compared with / result |",
             "|---|---|---|---|---|---|"]
    for record in records:
        for row in record.current:
            cells = [record.fill(row.measure), *_columns(record)[:4], record.fill(row.result)]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def render_older(records: list[Record]) -> list[str]:
    """The records without a current row (older measurements that tests and the forecast still read)."""
    lines = ["| measurement | hardware | date (record) | commit | command | compared with |", "|---|---|---|---|---|---|"]
    for record in (r for r in records if not r.current):
        title = f"{record.title}: {record.fill(record.summary)}" if record.summary else record.title
        cells = [title, *_columns(record), record.fill(record.compared_with)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def render_section(records: list[Record]) -> str:
    """BENCHMARKS.md's generated section, markers included."""
    return "\n".join([
        BEGIN, "## Current figures", "",
        "The newest measurement of each quantity, newest first. Each row is a record in `benchmarks/records/` (the "
        "date links it: hardware, software, setup, every measured value); its command reproduces it on that hardware.",
        "", *render_current(records), "",
        "### Older measurements kept as data", "",
        "Superseded by the figures above, kept because `tests/forecast/` checks `quant estimate` against them or "
        "`quant/forecast/throughputs.py` takes a rate from them; a figure here describes the engine of its commit.",
        "", *render_older(records), END])


def replace_section(text: str, section: str) -> str:
    """``text`` with its generated section (from BEGIN to END, both lines included) replaced by ``section``."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise RecordError(f"BENCHMARKS.md has no generated section (a line '{BEGIN}', later a line '{END}')")
    return text[:begin] + section + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render or check BENCHMARKS.md's section generated from the records.")
    p.add_argument("action", choices=["render", "check"])
    p.add_argument("--file", type=Path, default=BENCHMARKS_MD, help="the BENCHMARKS.md to render into or check")
    p.add_argument("--records", type=Path, default=RECORDS_DIR, help="the directory of *.json records")
    a = p.parse_args(argv)
    try:
        records = load_records(a.records)
        text = a.file.read_text()
        rendered = replace_section(text, render_section(records))
    except (RecordError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.action == "render":
        if rendered != text:
            a.file.write_text(rendered)
        print(f"{a.file.name}: generated section rendered from {len(records)} records")
        return 0
    if rendered != text:
        print(f"error: {a.file.name}'s generated section differs from the {len(records)} records in {a.records.name}/ "
              "(edited by hand, or a record changed): run `python benchmarks/records.py render`", file=sys.stderr)
        return 1
    print(f"{a.file.name}: generated section matches {len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
