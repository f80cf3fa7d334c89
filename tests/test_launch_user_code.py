"""sp_lab.launch with what a notebook defines: functions and classes that use ``torch.ops``, custom ops defined in
a cell, and mistakes refused in the caller before any rank starts.

A notebook is ``__main__``: what it defines is pickled by value and its cells never run in the ranks. The test
runs such a "notebook" as a script in a fresh interpreter (``python notebook.py``), which is the same situation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sp_lab
from sp_lab.bench.sweep import launch_sweep

REPO = Path(__file__).resolve().parents[1]

NOTEBOOK = textwrap.dedent('''
    import json
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    import sp_lab

    @torch.library.custom_op("nbcell::mix", mutates_args=())
    def mix(q: torch.Tensor, layer_name: str) -> torch.Tensor:
        return q.cumsum(0) / q.shape[0]

    @mix.register_fake
    def _(q, layer_name):
        return torch.empty_like(q)

    class Net(torch.nn.Module):
        """A model of the notebook's own: torch.ops.aten and the cell's custom op (a splitting op)."""

        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(2, 16, 16, generator=g) / 4)

        def forward(self, x):
            for i in range(2):
                y = funcol.all_reduce(torch.ops.aten.mm(x, self.w[i]), "sum", dist.group.WORLD)
                x = F.rms_norm(y, (16,))
                x = torch.ops.nbcell.mix(x, f"layers.{i}")
            return x

    def run(op):
        model = Net()
        config = sp_lab.LabConfig(tp_size=2, async_tp_min_tokens=4, max_num_tokens=32,
                                  splitting_ops=["nbcell::mix"])
        compiled = sp_lab.compile(model, config)
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            error = (compiled(x) - model(x)).abs().max().item()
        pieces = [p.op for p in compiled.report.range_for(10).pieces if p.kind == "splitting_op"]
        return {"error": error, "split_at": pieces, "op_counts": compiled.report.op_counts(10),
                "passed_op": op(torch.ones(2), "x").tolist()}

    out = {"results": sp_lab.launch(run, torch.ops.nbcell.mix.default, world_size=2, timeout=300)}

    lib = torch.library.Library("nblow", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: 2 * x, "CompositeExplicitAutograd")

    def low(x):
        return torch.ops.nblow.twice(x)

    # Count rank processes started from here on: a refusal in the caller starts none.
    import sp_lab.distributed.launch as launch_module
    started = []
    start_worker = launch_module.start_worker
    launch_module.start_worker = lambda *a, **k: (started.append(a[0]), start_worker(*a, **k))[1]
    try:
        sp_lab.launch(low, torch.ones(2), world_size=2)
    except Exception as e:  # the test checks it is a TypeError, after checking that no rank started
        out["low_level"] = f"{type(e).__name__}: {e}"
    out["low_level_ranks_started"] = started
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def notebook(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("nb") / "notebook.py"
    path.write_text(NOTEBOOK)
    done = subprocess.run([sys.executable, str(path)], check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


def test_notebook_model_with_its_own_custom_op_compiles_on_the_ranks(notebook):
    for rank in notebook["results"]:
        assert rank["error"] < 1e-5, rank
        assert rank["split_at"] == ["nbcell::mix", "nbcell::mix"]  # the cell's op, re-created in the rank
        assert rank["op_counts"]["reduce_scatter"] + rank["op_counts"]["fused_matmul_reduce_scatter"] == 2
        assert rank["passed_op"] == [0.5, 1.0]  # an OpOverload passed as an argument travels by name


def test_low_level_library_op_from_the_notebook_is_refused_before_launch(notebook):
    message = notebook["low_level"]
    assert notebook["low_level_ranks_started"] == [], f"ranks started before the refusal: {message}"
    assert message.startswith("TypeError: ") and "'nblow::twice'" in message, message
    assert "torch.library.custom_op" in message, message


def test_torch_ops_objects_travel_by_name():
    ops = [torch.ops, torch.ops.aten, torch.ops.aten.mm, torch.ops.aten.mm.default,
           torch.ops.higher_order.auto_functionalized]
    results = sp_lab.launch(_names_of, ops, world_size=2)
    assert results[0] == results[1] == _names_of(ops)


def _names_of(ops) -> list[str]:
    return [str(op) for op in ops]


class RankStarted(Exception):
    """Raised where a rank process would start: a mistake must be refused before that."""


@pytest.mark.parametrize("kwargs, match", [
    ({"model_name": "llama-3-8bb"}, "unknown model 'llama-3-8bb'"),
    ({"model_name": "toy", "tp_size": 4}, "tp_size=4 but world_size=2"),
    ({"model_name": "toy", "world_size": 3}, "tp_size=3 does not divide"),
])
def test_sweep_mistakes_are_reported_in_the_caller(tmp_path, monkeypatch, kwargs, match):
    import sp_lab.distributed.launch as launch_module

    def no_rank(rank, *args, **kwargs):
        raise RankStarted(f"rank {rank} was started before the mistake was refused")

    monkeypatch.setattr(launch_module, "start_worker", no_rank)
    with pytest.raises(ValueError, match=match):
        launch_sweep(store_dir=tmp_path, token_counts=[8], progress=False, **kwargs)


def test_a_config_for_another_tp_size_is_refused_in_the_caller():
    with pytest.raises(ValueError, match=r"tp_size=4 but world_size=2.*world_size=4"):
        sp_lab.launch(_names_of, [], config=sp_lab.LabConfig(tp_size=4), world_size=2)
