"""JSON the commands print: the same value for a JSON reader, with nothing raw that a terminal would act on."""
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnkit.cli._common import json_text

UNSAFE = [chr(c) for c in (0x7F, 0x85, 0x9B, 0x2028, 0x2029, 0x202A, 0x202E, 0x2066, 0x2069, 0xD800, 0xDFFF)]


@pytest.mark.parametrize("char", UNSAFE)
def test_each_unsafe_character_is_escaped(char):
    line = json_text({"text": f"a{char}b", "list": [char]})
    assert char not in line and f"\\u{ord(char):04x}" in line
    assert json.loads(line) == {"text": f"a{char}b", "list": [char]}
    line.encode("utf-8")  # lone surrogates escaped: the line can be written


@given(st.dictionaries(st.text(max_size=5), st.text(max_size=20) | st.integers() | st.none(), max_size=4))
def test_any_record_round_trips_and_only_printable_text_stays_raw(record):
    line = json_text(record)
    assert json.loads(line) == record
    assert "\n" not in line and not any(c in line for c in UNSAFE)
    assert not any(ord(c) < 0x20 for c in line)
