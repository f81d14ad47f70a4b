import pytest
from hypothesis import given
from hypothesis import strategies as st

from forkd.validation import ValidationError, check_range, check_sandbox_id, check_tag


@pytest.mark.parametrize("tag", ["a", "quickstart", "A-b_9", "x" * 64])
def test_good_tags_pass(tag: str) -> None:
    assert check_tag(tag) == tag


@pytest.mark.parametrize("tag", ["", "x" * 65, "../etc", "a/b", "a b", ".", "..", "tag\n", "é", None, 5])
def test_bad_tags_are_refused(tag: object) -> None:
    with pytest.raises(ValidationError, match="invalid tag"):
        check_tag(tag)


@given(st.text(max_size=80))
def test_accepted_tags_are_safe_path_components(tag: str) -> None:
    try:
        check_tag(tag)
    except ValidationError:
        return
    assert "/" not in tag and tag not in {".", ".."} and "\x00" not in tag and 1 <= len(tag) <= 64


def test_sandbox_ids() -> None:
    assert check_sandbox_id("sb-abcdef012345") == "sb-abcdef012345"
    for bad in ("sb-ABCDEF012345", "sb-123", "../sb-abcdef012345", "x"):
        with pytest.raises(ValidationError):
            check_sandbox_id(bad)


def test_ranges_refuse_bools_and_out_of_range() -> None:
    assert check_range(3, "n", 1, 10) == 3
    for bad in (True, 0, 11, 2.5, "3"):
        with pytest.raises(ValidationError, match="n must be"):
            check_range(bad, "n", 1, 10)
