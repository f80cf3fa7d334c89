"""The scheduler model against schedules worked out by hand (small traces, several budgets and caps).

Each expected schedule below was written from the rules in ``sp_lab/serving/scheduler.py``'s docstring before
the code ran: decodes first, then the prompt being chunked, then new requests first come first served while budget
and seats last; a request arriving during a step waits for the next.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sp_lab.serving.scheduler import SchedulerLimits, StepPrice, replay_steps, schedule
from sp_lab.serving.traffic import Request, Traffic

SECOND = 1e6  # a step price of one second makes step ends whole seconds


def _run(requests, budget, seqs, *, concurrency=None, us=SECOND):
    traffic = Traffic.of([Request(*r) for r in requests], concurrency=concurrency)
    return schedule(traffic, SchedulerLimits(budget, seqs), StepPrice.flat(budget, us))


def _spelled(sched):
    return [(s.tokens, s.decodes, s.prefills) for s in sched.steps()]


def test_budget_8_two_seats_chunks_the_second_prompt_and_holds_the_third_request():
    s = _run([(0, 5, 3), (0, 6, 2), (0, 3, 1)], budget=8, seqs=2)
    assert _spelled(s) == [
        (8, (), ((0, 5), (1, 3))),   # r1's prompt cut at the budget
        (4, (0,), ((1, 3),)),        # r0 decodes first, r1's prompt continues; r2 waits: both seats taken
        (2, (0, 1), ()),             # both decode and finish
        (3, (), ((2, 3),)),          # r2 gets a seat; one output token: done with its prompt
    ]
    assert s.first_token_step.tolist() == [1, 2, 4]
    assert s.finish_step.tolist() == [3, 3, 4]
    assert s.ttft_s().tolist() == [1.0, 2.0, 4.0]
    assert s.tpot_s().tolist() == [1.0, 1.0]  # r2 has one output token: no TPOT


def test_budget_4_splits_a_prompt_over_two_steps():
    s = _run([(0, 6, 2), (0, 2, 3)], budget=4, seqs=4)
    assert _spelled(s) == [(4, (), ((0, 4),)), (4, (), ((0, 2), (1, 2))), (2, (0, 1), ()), (1, (1,), ())]
    assert s.finish_step.tolist() == [3, 4]


def test_decodes_come_before_prefill_when_the_budget_binds():
    # r1 arrives during step 1; each later step gives r0's decode its token first and r1's prompt the rest
    s = _run([(0, 1, 4), (0.5, 7, 1)], budget=4, seqs=4)
    assert _spelled(s) == [(1, (), ((0, 1),)), (4, (0,), ((1, 3),)), (4, (0,), ((1, 3),)), (2, (0,), ((1, 1),))]
    assert s.finish_step.tolist() == [4, 4]
    assert s.ttft_s().tolist() == [1.0, 3.5]


def test_a_request_arriving_mid_step_waits_for_the_next_step():
    s = _run([(0, 2, 3), (1.5, 1, 1)], budget=8, seqs=4)
    assert _spelled(s) == [(2, (), ((0, 2),)), (1, (0,), ()), (2, (0,), ((1, 1),))]
    assert s.first_token_s.tolist() == [1.0, 3.0]
    assert s.finish_s.tolist() == [3.0, 3.0]
    assert s.ttft_s().tolist() == [1.0, 1.5]


def test_idle_gap_jumps_to_the_next_arrival():
    s = _run([(0, 1, 1), (10, 1, 1)], budget=8, seqs=4)
    assert s.run_start_s.tolist() == [0.0, 10.0]
    assert s.busy_s == 2.0 and s.span_s == 11.0


def test_seat_cap_makes_a_decode_run_and_admits_after_the_finish():
    s = _run([(0, 2, 3), (0, 2, 1)], budget=8, seqs=1)
    assert _spelled(s) == [(2, (), ((0, 2),)), (1, (0,), ()), (1, (0,), ()), (2, (), ((1, 2),))]
    assert s.run_steps.tolist() == [1, 2, 1]  # the two identical decode steps are one run


def test_closed_loop_sends_the_next_request_when_an_answer_returns():
    s = _run([(0, 2, 2), (0, 3, 1)], budget=8, seqs=4, concurrency=1)
    assert _spelled(s) == [(2, (), ((0, 2),)), (1, (0,), ()), (3, (), ((1, 3),))]
    assert s.arrival_s.tolist() == [0.0, 2.0]
    assert s.ttft_s().tolist() == [1.0, 1.0]


def test_decode_run_time_grows_with_the_context_read():
    # one request, prompt 3, 4 output tokens: decodes read contexts 4, 5, 6 (prompt + tokens so far)
    traffic = Traffic((Request(0, 3, 4),))
    price = StepPrice((0.0,) + (100.0,) * 8, kv_us_per_token=10.0)
    s = schedule(traffic, SchedulerLimits(8, 2), price)
    assert s.run_steps.tolist() == [1, 3]
    assert s.run_kv_tokens.tolist() == [0, 4 + 5 + 6]
    assert s.run_time_s.tolist() == pytest.approx([100e-6, (3 * 100 + 10 * 15) * 1e-6])


def test_long_run_of_decodes_stops_exactly_when_a_request_arrives():
    # 1 s decode steps; the second request arrives at 3.5 s: admitted in the step after the one ending at 4 s
    s = _run([(0, 1, 10), (3.5, 1, 1)], budget=8, seqs=4)
    tokens = s.step_tokens().tolist()
    assert tokens[:5] == [1, 1, 1, 1, 2]
    assert s.first_token_s[1] == 5.0


def test_every_request_finishes_and_tokens_add_up_on_a_random_trace():
    rng = np.random.default_rng(3)
    reqs = [(float(a), int(p), int(o)) for a, p, o in zip(np.sort(rng.uniform(0, 20, 300)),
                                                          rng.integers(1, 300, 300), rng.integers(1, 50, 300),
                                                          strict=True)]
    s = _run(reqs, budget=64, seqs=16, us=1000.0)
    prompts = sum(p for _, p, _ in reqs)
    decodes = sum(o - 1 for _, _, o in reqs)
    assert int((s.run_tokens * s.run_steps).sum()) == prompts + decodes
    assert int((s.run_decodes * s.run_steps).sum()) == decodes
    assert (s.step_tokens() <= 64).all()
    assert not np.isnan(s.finish_s).any() and (s.finish_s >= s.first_token_s).all()
    assert (s.first_token_s > s.arrival_s).all()


def test_limits_refuse_a_budget_below_the_seat_cap():
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 < max_num_seqs=8"):
        SchedulerLimits(4, 8)


def test_a_price_that_does_not_cover_the_budget_is_refused():
    with pytest.raises(ValueError, match="up to 16"):
        schedule(Traffic((Request(0, 1, 1),)), SchedulerLimits(16, 4), StepPrice.flat(8))


def test_replayed_steps_are_priced_in_order():
    s = replay_steps([1, 3, 3], StepPrice((0.0, 10.0, 20.0, 30.0)))
    assert s.run_time_s.tolist() == pytest.approx([10e-6, 30e-6, 30e-6])
    assert s.run_start_s.tolist() == pytest.approx([0.0, 10e-6, 40e-6])
    assert s.ttft_s().size == 0 and math.isclose(s.busy_s, 70e-6)
