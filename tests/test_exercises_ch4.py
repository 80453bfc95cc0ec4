"""Chapter 4 exercises: the solutions score full marks, typical mistakes do not, and say why."""
import pytest

import fa_lab  # noqa: F401  (first: picks the world)
from fa_lab.exercises import ch4, check


def test_key_block_ranges_solution_passes():
    assert check("ch4_key_block_ranges", ch4.key_block_ranges).passed


@pytest.mark.parametrize("mistake", ch4.RANGE_MISTAKES, ids=lambda m: m.name)
def test_key_block_ranges_mistakes_fail(mistake):
    result = check("ch4_key_block_ranges", mistake.fn)
    assert not result.passed
    assert result.first_failure["message"].startswith("wrong answer")


def test_key_block_ranges_rejects_overlapping_ranges():
    def overlapping(m_start, block_m, block_n, n_q, n_k, left=-1, right=-1):
        lo, mid_lo, mid_hi, hi = ch4.key_block_ranges(m_start, block_m, block_n, n_q, n_k, left, right)
        return lo, mid_lo, mid_hi, hi + block_n  # one block past the end: visits nothing visible
    assert not check("ch4_key_block_ranges", overlapping).passed


def test_triton_solution_passes_in_this_world():
    assert check("ch4_flash_forward", ch4.flash_forward_triton).passed


@pytest.mark.parametrize("mistake", ch4.FLASH_MISTAKES, ids=lambda m: m.name)
def test_flash_forward_mistakes_are_named(mistake):
    result = check("ch4_flash_forward", mistake.fn)
    assert not result.passed
    assert mistake.name in " ".join(r.get("diagnosis", "") for r in result.rows)


def test_stubs_get_feedback_not_an_exception():
    def stub(*args, **kwargs):
        raise NotImplementedError
    for name in ("ch4_key_block_ranges", "ch4_flash_forward"):
        result = check(name, stub)
        assert not result.passed and "not implemented" in result.first_failure["message"]
