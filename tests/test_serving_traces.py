"""Request traces and step lists from files: good rows read, bad rows refused by line with the reason; named
workloads sampled with their arrival processes."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from sp_lab.serving.traces import TraceError, read_steps, read_trace
from sp_lab.serving.traffic import poisson_arrivals
from sp_lab.serving.workloads import workload


def test_csv_trace_reads_and_sorts_by_arrival(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,user\n0.5,10,3,a\n0.0,20,1,b\n")
    traffic = read_trace(path, concurrency=4)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in traffic.requests] == [(0.0, 20, 1), (0.5, 10, 3)]
    assert traffic.concurrency == 4 and traffic.name == "t.csv"


def test_csv_bad_rows_are_refused_by_line_with_the_reason(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,3\n-1,10,3\n0,12.5,0\n0,,3\n")
    with pytest.raises(TraceError) as e:
        read_trace(path)
    msg = str(e.value)
    assert "3 bad rows" in msg
    assert "line 3: arrival_s '-1' is not a number of seconds >= 0" in msg
    assert "line 4: prompt_tokens '12.5' is not an integer >= 1; output_tokens '0' is not an integer >= 1" in msg
    assert "line 5: missing prompt_tokens" in msg


def test_csv_header_without_the_columns_is_refused(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("time,in,out\n0,1,1\n")
    with pytest.raises(TraceError, match="header .line 1. must name arrival_s, prompt_tokens, output_tokens"):
        read_trace(path)


def test_jsonl_trace_and_its_bad_lines(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\n\n'
                    '{"arrival_s": 1.5, "prompt_tokens": 7, "output_tokens": 1}\n')
    assert len(read_trace(good).requests) == 2
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 2}\nnot json\n[1, 2]\n'
                   '{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 2}\n')
    with pytest.raises(TraceError) as e:
        read_trace(bad)
    assert "line 2: not JSON" in str(e.value) and "line 3: expected an object" in str(e.value)
    assert "line 4: prompt_tokens True is not an integer >= 1" in str(e.value)


def test_parquet_trace(tmp_path):
    path = tmp_path / "t.parquet"
    pl.DataFrame({"arrival_s": [0.0, 1.0], "prompt_tokens": [3, 0], "output_tokens": [1, 1]}).write_parquet(path)
    with pytest.raises(TraceError, match="line 2: prompt_tokens 0 is not an integer >= 1"):
        read_trace(path)


def test_unknown_format_is_refused(tmp_path):
    path = tmp_path / "t.xlsx"
    path.write_text("")
    with pytest.raises(TraceError, match="use .csv, .jsonl or .parquet"):
        read_trace(path)


def test_step_lists(tmp_path):
    text = tmp_path / "s.txt"
    text.write_text("num_tokens\n1\n64\n\n8192\n")
    assert read_steps(text) == [1, 64, 8192]
    js = tmp_path / "s.json"
    js.write_text(json.dumps([3, 4]))
    assert read_steps(js) == [3, 4]
    bad = tmp_path / "b.txt"
    bad.write_text("1\nx\n0\n")
    with pytest.raises(TraceError, match=r"line 2: 'x' is not a token count.*\n.*line 3: '0'"):
        read_steps(bad)


def test_workloads_sample_their_means_and_respect_the_context():
    t = workload("chat").traffic(20000, rate_per_s=10, seed=1)
    prompts = np.array([r.prompt_tokens for r in t.requests])
    outputs = np.array([r.output_tokens for r in t.requests])
    assert prompts.mean() == pytest.approx(161, rel=0.05) and outputs.mean() == pytest.approx(338, rel=0.05)
    clipped = workload("summarization").traffic(500, concurrency=8, max_model_len=4096)
    assert all(r.prompt_tokens + r.output_tokens <= 4096 for r in clipped.requests)
    assert clipped.concurrency == 8 and all(r.arrival_s == 0 for r in clipped.requests)
    fixed = workload("random").traffic(3, concurrency=1)
    assert {(r.prompt_tokens, r.output_tokens) for r in fixed.requests} == {(1024, 128)}
    with pytest.raises(ValueError, match="unknown workload 'chatty'; choose from chat, lmsys-chat"):
        workload("chatty")
    with pytest.raises(ValueError, match="give a request rate"):
        workload("chat").traffic(10)


def test_poisson_arrivals_have_the_rate():
    times = poisson_arrivals(50000, 20.0, seed=2)
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    assert len(times) / times[-1] == pytest.approx(20.0, rel=0.03)
