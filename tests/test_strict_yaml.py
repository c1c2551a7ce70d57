"""Strict YAML: plain data only, duplicate keys, bounded nesting and alias expansion, UTF-8 without control chars."""

import re
import time

import pytest

from quant import strict_yaml
from quant.errors import RecipeError
from tests.conftest import REPO


def load(text: str):
    return strict_yaml.load(text, "doc", RecipeError)


@pytest.mark.parametrize("text,tag", [
    ("a: !!binary aGVsbG8=", "!!binary"),
    ("a: !!set {x, y}", "!!set"),
    ("a: !!timestamp 2024-01-01", "!!timestamp"),
    ("a: !!omap [x: 1]", "!!omap"),
    ("a: !!python/object:os.system x", "!!python/object:os.system"),
    ("a: !local x", "!local"),
])
def test_tags_other_than_plain_data_are_refused(text, tag):
    with pytest.raises(RecipeError, match=f"unsupported YAML tag '{tag}' at line 1"):
        load(text)


def test_dates_stay_strings():
    assert load("a: 2024-01-01\nb: 2024-01-01T10:00:00Z\nc: 2024-01-01 10:00:00") == {
        "a": "2024-01-01", "b": "2024-01-01T10:00:00Z", "c": "2024-01-01 10:00:00"}


def test_duplicate_keys_are_refused_merge_keys_are_not():
    with pytest.raises(RecipeError, match="duplicate key 'a' at line 3 \\(first at line 1\\)"):
        load("a: 1\nb: 2\n'a': 3")
    assert load("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3") == {"base": {"x": 1, "y": 2}, "c": {"x": 1, "y": 3}}


@pytest.mark.parametrize("text", ["a: " + "[" * 5000 + "]" * 5000, "a: " + "{b: " * 3000 + "1" + "}" * 3000,
                                  "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 40)) + "  " * 40 + "v"])
def test_deep_nesting_is_refused_before_recursion(text):
    with pytest.raises(RecipeError, match="nesting deeper than 16 levels"):
        load(text)


def test_billion_laughs_is_refused_without_expanding():
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 9)]
    t0 = time.perf_counter()
    with pytest.raises(RecipeError, match="expands to more than 10000 values"):
        load("\n".join(lines))
    assert time.perf_counter() - t0 < 2.0
    assert load("a: &a [1, 2]\nb: *a\nc: *a") == {"a": [1, 2], "b": [1, 2], "c": [1, 2]}  # small reuse is fine


def test_recursive_alias_is_refused():
    with pytest.raises(RecipeError, match="recursive YAML alias"):
        load("a: &a [1, *a]")


def test_text_checks():
    with pytest.raises(RecipeError, match="not UTF-8 text \\(byte 0xff at offset 3\\)"):
        strict_yaml.decode(b"a: \xff", "doc", RecipeError)
    with pytest.raises(RecipeError, match="control character '\\\\x07'"):
        load("a: b\x07c")
    with pytest.raises(RecipeError, match="at most"):
        strict_yaml.decode(b"a" * (strict_yaml.MAX_BYTES + 1), "doc", RecipeError)
    assert load("a: 1\r\nb: 'x\ty'\r\n") == {"a": 1, "b": "x\ty"}


def test_values_must_be_plain():
    with pytest.raises(RecipeError, match="does not fit in 64 bits"):
        load("a: 99999999999999999999999")
    with pytest.raises(RecipeError, match="is not a string"):
        load("1: x")
    with pytest.raises(RecipeError, match="malformed YAML .*line 2"):
        load("a: 1\n---\nb: 2")


@pytest.mark.parametrize("value, named", [("18446744073709551616", "--set calibration.seed: integer"),
                                          ("[1, 18446744073709551616]", "'--set calibration.seed[1]': integer")])
def test_a_set_value_that_is_not_plain_names_its_key(value, named):
    """`--set calibration.seed=2**64` said "error: '': integer ... does not fit", naming no key, while the same value
    in a recipe file names calibration.seed."""
    from quant.recipe import load_recipe

    with pytest.raises(RecipeError, match=re.escape(named) + " .*does not fit in 64 bits"):
        load_recipe(REPO / "recipes" / "mixed_int8_int4.yaml", overrides=(f"calibration.seed={value}",))
    with pytest.raises(RecipeError, match="'calibration.seed': integer 18446744073709551616 does not fit"):
        load("calibration:\n  seed: 18446744073709551616")  # in a file: the dotted key
