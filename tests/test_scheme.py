"""quant.scheme: the one scheme type, its recipe name and its integer range."""

import pytest

from quant.scheme import Scheme


def test_a_recipe_name_parses_to_the_symmetric_scheme_and_back():
    s = Scheme.parse("w4g128")
    assert s == Scheme(4, 128, True) and s.label == "w4g128" and Scheme(8, 32, False).label == "w8g32a"
    assert sorted(map(Scheme.parse, ["w8g32", "w4g64", "w4g32"])) == [Scheme(4, 32), Scheme(4, 64), Scheme(8, 32)]


def test_the_integer_range_and_packing_follow_the_bits():
    assert (Scheme(4, 128).qmin, Scheme(4, 128).qmax, Scheme(4, 128).pack_factor) == (-8, 7, 8)
    assert (Scheme(8, 32).qmin, Scheme(8, 32).qmax, Scheme(8, 32).pack_factor) == (-128, 127, 4)


@pytest.mark.parametrize("name,message", [("w4", "written w<bits>g<group>"), ("w5g128", "bits of scheme"),
                                          ("w4g12", "power of two >= 8")])
def test_a_bad_name_says_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=message):
        Scheme.parse(name)
