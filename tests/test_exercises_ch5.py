"""Chapter 5 exercises: the solutions score full marks, each classic mistake fails and is named."""
import pytest

from fa_lab.exercises import check, get, names


@pytest.mark.parametrize("name", names(5))
def test_solution_scores_full_marks(name):
    result = check(name, get(name).solution, seeds=(0, 1))
    assert result.passed, result.first_failure


@pytest.mark.parametrize("name,mistake", [(n, m) for n in names(5) for m in get(n).mistakes],
                         ids=lambda x: getattr(x, "name", x))
def test_each_mistake_fails_with_its_diagnosis(name, mistake):
    result = check(name, mistake.fn, seeds=(0, 1))
    assert not result.passed
    diagnoses = " ".join(str(r.get("diagnosis", "")) for r in result.rows if not r["passed"])
    assert mistake.name in diagnoses, diagnoses[:500]
