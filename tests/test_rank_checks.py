"""The shared launch's per-case results (tests/rank_checks.py): a case that raises on a rank fails its own test,
named, and its module's other cases still report their own results. No launch: the per-rank results are made here,
as each rank makes them, and a parametrised module reading them runs under pytest's own tester."""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_checks

pytest_plugins = ["pytester"]


def _run_case(case: str) -> dict[str, int]:
    if case == "broken":
        raise ValueError("the broken case's own error")
    return {"value": len(case)}


def test_a_raising_case_is_recorded_and_the_next_case_runs():
    ran = rank_checks.run_cases(["first", "broken", "third"], lambda case: case, _run_case)
    assert list(ran) == ["first", "broken", "third"]
    assert ran["first"] == {"value": 5} and ran["third"] == {"value": 5}
    error = ran["broken"]
    assert isinstance(error, rank_checks.CaseError) and error.case == "broken"
    assert "ValueError: the broken case's own error" in error.traceback and "_run_case" in error.traceback


def test_reading_a_case_fails_only_for_the_case_that_raised_naming_it_and_the_rank():
    per_rank = [rank_checks.run_cases(["first", "broken"], lambda case: case, _run_case),
                rank_checks.run_cases(["first", "broken"], lambda case: case,
                                      lambda case: {"value": 0} if case == "broken" else _run_case(case))]
    assert rank_checks.case_results(per_rank, "first") == [{"value": 5}, {"value": 5}]
    with pytest.raises(pytest.fail.Exception, match=r"rank-check case broken raised on rank 0:\n(.|\n)*ValueError"):
        rank_checks.case_results(per_rank, "broken")
    with pytest.raises(KeyError, match="no rank-check case 'absent'; the ranks ran"):
        rank_checks.case_results(per_rank, "absent")


def test_a_parametrised_module_reports_the_broken_case_and_passes_the_others(pytester):
    pytester.syspathinsert(str(Path(rank_checks.__file__).parent))
    pytester.makepyfile(test_cases='''
        import pytest
        import rank_checks

        CASES = ["alpha", "broken", "gamma"]

        def run_case(case):
            if case == "broken":
                raise RuntimeError("only this case is broken")
            return case.upper()

        @pytest.fixture(scope="module")
        def ranks():
            return [rank_checks.run_cases(CASES, lambda c: c, run_case) for _ in range(2)]

        @pytest.mark.parametrize("case", CASES)
        def test_case(ranks, case):
            assert rank_checks.case_results(ranks, case) == [case.upper()] * 2
    ''')
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_cases.py::test_case[[]broken[]]*"])
    out = result.stdout.str()
    assert "rank-check case broken raised on rank 0" in out and "only this case is broken" in out
    assert "FAILED test_cases.py::test_case[alpha]" not in out and "ERROR" not in out
