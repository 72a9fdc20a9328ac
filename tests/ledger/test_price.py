"""What a request costs, in micro-units, against amounts worked out by hand.

A price is micro-units per million tokens. A request is charged its prompt tokens and
its completion tokens at their prices, the sum rounded up to a whole micro-unit: no
fraction of a token goes unbilled, and nothing is rounded twice. Every expected
amount below is a literal with its arithmetic beside it, never ``cost()`` itself, so a
wrong rounding rule (down, to nearest, per part) or float arithmetic fails here.
"""

from __future__ import annotations

import pytest

from tokenmill.config import Price
from tokenmill.metering import cost


@pytest.mark.parametrize(
    ("prompt_per_mtok", "completion_per_mtok", "prompt", "completion", "expected"),
    [
        # Whole micro-units a token: no rounding at all.
        pytest.param(1_000_000, 3_000_000, 4, 1, 7, id="4x1 + 1x3"),
        pytest.param(2_000_000, 5_000_000, 4, 3, 23, id="4x2 + 3x5"),
        # Half micro-units: a half is rounded up, a whole sum is not.
        pytest.param(1_500_000, 3_000_000, 1, 0, 2, id="1.5 up to 2"),
        pytest.param(1_500_000, 3_000_000, 2, 0, 3, id="3.0 stays 3"),
        pytest.param(1_500_000, 3_000_000, 3, 1, 8, id="4.5 + 3 = 7.5 up to 8"),
        pytest.param(0, 1_500_000, 0, 1, 2, id="a completion's 1.5 up to 2"),
        # Rounded once, on the sum: rounding each part would give 2 + 2 and 1 + 1.
        pytest.param(1_500_000, 1_500_000, 1, 1, 3, id="1.5 + 1.5 = 3"),
        pytest.param(500_000, 500_000, 1, 1, 1, id="0.5 + 0.5 = 1"),
        # The edges of one micro-unit at the smallest price, 1 per million tokens.
        pytest.param(1, 0, 1, 0, 1, id="a millionth up to 1"),
        pytest.param(1, 0, 999_999, 0, 1, id="0.999999 up to 1"),
        pytest.param(1, 0, 1_000_000, 0, 1, id="exactly 1"),
        pytest.param(1, 0, 1_000_001, 0, 2, id="1.000001 up to 2"),
        pytest.param(999_999, 0, 1_000_000, 0, 999_999, id="a million at 999_999"),
        # Zero: a free price, and no tokens at a price.
        pytest.param(0, 0, 1_000_000, 1_000_000, 0, id="free"),
        pytest.param(3_000_000, 15_000_000, 0, 0, 0, id="no tokens"),
        # Large counts stay exact integers.
        pytest.param(3_000_000, 15_000_000, 10**9, 10**9, 18_000_000_000, id="1e9 x 3 + 1e9 x 15"),
        # 123_456_789 x 7 + 987_654_321 x 11 = 864_197_523 + 10_864_197_531
        # = 11_728_395_054 per million = 11_728.395054, up to 11_729.
        pytest.param(7, 11, 123_456_789, 987_654_321, 11_729, id="odd prices"),
        # (10**22 + 1) / 10**6 = 10**16 + 0.000001, up to 10**16 + 1; in floats
        # 10**22 + 1 is 1e22 and the charge would come out as 10**16.
        pytest.param(1, 0, 10**22 + 1, 0, 10**16 + 1, id="beyond float precision"),
    ],
)
def test_a_charge_is_the_sum_at_the_prices_rounded_up_once(
    prompt_per_mtok: int, completion_per_mtok: int, prompt: int, completion: int, expected: int
) -> None:
    price = Price(prompt_per_mtok=prompt_per_mtok, completion_per_mtok=completion_per_mtok)
    assert cost(price, prompt, completion) == expected


def test_no_price_is_free() -> None:
    assert cost(None, 1_000_000, 1_000_000) == 0
