"""sp_lab's on-disk artifact cache: an entry serves a restart whose Inductor cache is empty; a changed config
field or pass never gets another's entry.

One toy model on the fake group (tp 2, real CPU code, the SP range [8, 64]), compiled four times in a row
with ``SP_LAB_CACHE_DIR`` in a temporary directory:

1. into an empty sp_lab cache: a miss, the entry is saved;
2. the same, with Inductor pointed at an *empty* directory (what a new machine, a wiped ``/tmp`` or another
   container sees): a hit, and every piece is an Inductor cache hit that only the loaded entry can explain;
3. one LabConfig field changed: a miss;
4. the passes' sources changed (their ``uuid()``): a miss, and the pass really ran (Inductor compiled afresh).

A restart in a new process is (2) plus Dynamo's capture; ``benchmarks/bench_compile.py`` times it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import sp_lab
from sp_lab.compiler import inspection
from sp_lab.compiler.artifact_cache import range_key
from sp_lab.compiler.passes import post_grad
from sp_lab.compiler.ranges import CompileRange
from sp_lab.distributed.collectives import fake_process_group

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
CONFIG = sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=8, max_num_tokens=64)  # test_compiler_backend's toy


def _sp_range(model: torch.nn.Module, config: sp_lab.LabConfig) -> Any:
    compiled = sp_lab.compile(model, config)
    compiled(torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(12)))
    return compiled.report.range_for(12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sp_lab_dir = tmp_path_factory.mktemp("sp_lab_cache")
    before = {k: os.environ.get(k) for k in ("SP_LAB_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    os.environ["SP_LAB_CACHE_DIR"] = str(sp_lab_dir)
    out: dict[str, Any] = {}
    try:
        with fake_process_group(TP):
            model = sp_lab.models.build("toy", tp_rank=0, tp_size=TP)
            out["first"] = _sp_range(model, CONFIG)
            out["entries"] = sorted(p.name for p in (sp_lab_dir / "ranges").iterdir())
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("empty_inductor"))
            out["restart"] = _sp_range(model, CONFIG)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before["TORCHINDUCTOR_CACHE_DIR"] or ""
            # An op the toy does not call: the same pieces, yet another config.
            other_ops = dataclasses.replace(CONFIG, splitting_ops=[*CONFIG.splitting_ops, "aten::cumsum"])
            out["config_changed"] = _sp_range(model, other_ops)
            # The pass manager's uuid covers the sources its records are written with: change one.
            original = Path(inspection.__file__)
            changed = tmp_path_factory.mktemp("passes") / original.name
            changed.write_text(original.read_text() + "\n# changed\n")
            sources = [changed if p == original else p for p in post_grad._RECORD_SOURCES]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(post_grad, "_RECORD_SOURCES", sources)
                out["pass_changed"] = _sp_range(model, CONFIG)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out


def _compiled_pieces(entry: Any) -> list[Any]:
    return [p for p in entry.pieces if p.kind == "compiled"]


def test_a_first_compile_misses_and_saves_an_entry(runs):
    assert runs["first"].artifact_cache == "miss"
    assert len(runs["entries"]) == 1 and runs["entries"][0].endswith(".bin")


def test_an_entry_serves_a_restart_with_an_empty_inductor_cache(runs):
    restart = runs["restart"]
    assert restart.artifact_cache == "hit"
    # Inductor's directory was empty: only the loaded entry can make its caches hit.
    assert all(p.inductor_cache_hit or p.cache_hit for p in _compiled_pieces(restart))
    assert restart.op_counts() == runs["first"].op_counts()  # the same artifact, with its pass record


def test_a_changed_config_field_is_a_miss(runs):
    assert runs["config_changed"].artifact_cache == "miss"


def test_a_changed_pass_is_a_miss_and_compiles_afresh(runs):
    changed = runs["pass_changed"]
    assert changed.artifact_cache == "miss"
    # Inductor keys on the pass uuid too: nothing compiled before under this pass, so the pass ran again.
    assert not any(p.inductor_cache_hit for p in _compiled_pieces(changed))
    assert changed.op_counts() == runs["first"].op_counts()


@pytest.mark.parametrize("field, value", [("heuristic_default", "no_fuse"), ("boundary", "gather"),
                                          ("cudagraph_capture_sizes", [16]), ("token_dim", 1)])
def test_the_key_changes_with_any_config_field_alone(field, value):
    """Everything else held: graph, inputs, effective config, range, pass uuid."""
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    inputs = [torch.empty(3, 4)]
    rng = CompileRange(8, 64, enable_sp=True, enable_async_tp=True)
    key = range_key(gm, inputs, CONFIG, {"device": "cpu"}, rng, "pass-uuid")
    assert range_key(gm, inputs, CONFIG, {"device": "cpu"}, rng, "pass-uuid") == key
    changed = dataclasses.replace(CONFIG, **{field: value})
    assert range_key(gm, inputs, changed, {"device": "cpu"}, rng, "pass-uuid") != key
    assert range_key(gm, inputs, CONFIG, {"device": "cpu"}, rng, "other-pass-uuid") != key
