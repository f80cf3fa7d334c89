"""sp_lab.programs: one table says which program runs at which token count; sweep, regret and policy agree."""

from __future__ import annotations

import pytest

from sp_lab import programs
from sp_lab.bench import sweep
from sp_lab.config import LabConfig
from sp_lab.tuning import policy, regret

TOKENS = (1, 7, 8, 63, 64, 65, 255, 256, 4096)


def test_bench_and_tuning_use_the_one_owner():
    # one definition each: the sweep's and the tuner's names are the programs module's objects
    assert sweep.variant_config is programs.variant_config and sweep.expectation is programs.expectation
    assert regret.variant_run is programs.variant_run and policy.Policy is programs.Policy
    assert programs.REFERENCE_VARIANTS == ("baseline", "sp", "sp+async_tp")


@pytest.mark.parametrize("program", programs.PROGRAMS, ids=lambda p: p.variant)
def test_every_program_is_what_its_sweep_config_runs_at_every_token_count(program):
    base = LabConfig(tp_size=2, async_tp_min_tokens=64, sp_min_tokens=8, heuristic=None)
    config = programs.variant_config(program.variant, base)
    assert config.enable_sp == program.sp and config.enable_async_tp == program.async_tp
    assert config.heuristic is None and config.sp_min_tokens is None
    assert [programs.variant_run(config, t) for t in TOKENS] == [program.variant] * len(TOKENS)
    assert programs.Policy.of(config) == programs.Policy.constant(program.variant)
    for t in TOKENS:
        expect = programs.expectation(config, t)
        assert (expect.sp, expect.fusion) == (program.sp, program.async_tp), t


def test_a_two_gate_config_runs_three_programs_and_the_policy_says_so():
    config = LabConfig(tp_size=4, sp_min_tokens=8, async_tp_min_tokens=64)
    # written out by hand from the gates: SP from 8 tokens, fusion from 64
    want = ["baseline", "baseline", "sp", "sp", "sp+async_tp", "sp+async_tp", "sp+async_tp", "sp+async_tp",
            "sp+async_tp"]
    assert [programs.variant_run(config, t) for t in TOKENS] == want
    assert programs.Policy.of(config).steps == ((1, "baseline"), (8, "sp"), (64, "sp+async_tp"))
    assert programs.Policy.of(config).to_config(config) == config
    # one rank has nothing to rewrite whatever the gates say
    assert programs.Policy.of(LabConfig(tp_size=1, async_tp_min_tokens=1)) == programs.Policy.constant("baseline")


def test_an_unknown_variant_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown variant 'sp\+fp8'.*'baseline', 'sp', 'sp\+async_tp', 'tuned'"):
        programs.variant_config("sp+fp8", LabConfig())
