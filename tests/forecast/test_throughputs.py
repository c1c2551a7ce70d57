"""quant/forecast/throughputs.py: each constant names, in the comment above it, the record of benchmarks/records/ it
was taken from, and equals the value that record holds under its name (``rates``); a record's rates are all
constants that name it. The package itself never reads the records, which the wheel does not ship
(tests/test_imports.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.records import load_record, load_records
from quant.forecast import throughputs
from quant.forecast.throughputs import THROUGHPUTS

RECORD_NAME = re.compile(r"\b(\d{4}-\d{2}-\d{2}-[a-z0-9-]+)\.json\b")


def _named_records() -> dict[str, str]:
    """constant -> the record its comment block names (a constant without a comment of its own shares the one above)."""
    source = Path(throughputs.__file__).read_text()
    body = source[source.index("THROUGHPUTS = {"):].split("\n}\n", 1)[0].splitlines()[1:]
    named, block, names = {}, [], []
    for line in body:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped)
            continue
        if block:
            names, block = RECORD_NAME.findall(" ".join(block)), []
            assert len(names) == 1, f"the comment above {stripped!r} must name one record file, names {names}"
        key = re.match(r'"(\w+)":', stripped)
        if key:
            assert names, f"{key.group(1)} has no comment naming its record"
            named[key.group(1)] = names[0]
    return named


def test_every_constant_names_its_record():
    assert set(_named_records()) == set(THROUGHPUTS)


@pytest.mark.parametrize("constant", sorted(THROUGHPUTS))
def test_each_constant_equals_the_rate_its_record_holds(constant):
    record = load_record(_named_records()[constant])
    assert constant in record.rates, f"{record.name}.json has no rates.{constant}"
    assert THROUGHPUTS[constant] == record.rates[constant], (record.name, constant)


def test_a_records_rates_are_constants_that_name_it():
    named = _named_records()
    stray = [(r.name, k) for r in load_records() for k in r.rates if named.get(k) != r.name]
    assert not stray, stray

