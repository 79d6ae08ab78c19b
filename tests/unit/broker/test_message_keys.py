"""The canonical JSON that echo keys and digests are written with (`broker.message_keys.canonical_json`)."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from broker.message_keys import canonical_json

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.1, 1e16, 1e-05, -0.0, math.nan]),
    st.text(),  # surrogates, controls and non-ASCII text included
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        | st.dictionaries(st.one_of(st.integers(-2, 2), st.text(max_size=1)), inner, max_size=3)
    ),  # unsortable keys
    max_leaves=12,
)


@given(_values)
def test_canonical_json_is_the_stdlib_sorted_compact_text_or_else_repr(value):
    """What digests recorded by every earlier version were written with: json.dumps with sorted keys, no spaces and
    str() for other types; repr where the keys cannot be sorted."""
    try:
        expected = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    except TypeError:
        expected = repr(value)
    assert canonical_json(value) == expected
