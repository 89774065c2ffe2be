"""Public ids of numbered rows: opaque, reversible with the key, old decimal ids accepted."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.public_ids import MAX_KEY, PublicIds

IDS = PublicIds(b"k" * 32)


@settings(max_examples=300, derandomize=True)
@given(pk=st.integers(min_value=0, max_value=MAX_KEY), prefix=st.sampled_from(["msg", "job"]))
def test_an_id_reads_back_as_its_row(pk: int, prefix: str) -> None:
    shown = IDS.format(prefix, pk)
    assert re.fullmatch(f"{prefix}_[b-df-hj-np-tv-xz]{{15}}", shown)
    assert IDS.parse(prefix, shown) == pk


def test_ids_say_nothing_of_the_count_and_depend_on_the_key_and_the_kind() -> None:
    shown = [IDS.format("msg", pk) for pk in range(1, 200)]
    assert len(set(shown)) == len(shown) and shown != sorted(shown)
    assert not any(str(pk) in s for pk, s in zip(range(1, 200), shown, strict=True))
    assert IDS.format("msg", 18) != PublicIds(b"j" * 32).format("msg", 18)
    assert IDS.format("msg", 18)[4:] != IDS.format("job", 18)[4:]


def test_old_decimal_ids_are_accepted_and_others_are_not_ids() -> None:
    assert IDS.parse("msg", "msg_18") == 18
    assert IDS.parse("job", "job_10") == 10
    for value in ["msg_", "job_18", "msg_1x", "msg_" + "b" * 16, "18", "msg_-1", "msg_A" * 2]:
        assert IDS.parse("msg", value) is None, value
    assert IDS.parse("msg", "msg_" + "z" * 15) is None  # (beyond 64 bits)
