"""Every key that lets sp_lab reuse compiled work, varied field by field: a cache or a key is a promise about every
field it leaves out, and silent reuse of a wrong artifact returns wrong numbers without an error.

- the call signature (``compiler/capture.py``): which capture a call may run. Two calls that differ in a tensor's
  dtype, device, grad, a non-token dimension or another argument's value never share one; two that differ only
  in the token count do, within the capture's token guards;
- shared captures across the variants of one model (``SharedCaptures.find``): a capture serves a variant only
  at token counts its guards hold for, whichever variant captured it;
- the on-disk artifact key (``compiler/artifact_cache.py`` ``range_key``): the range, every input's dtype, shape,
  stride and device, the trace hint, the effective config (tp, device, group), every LabConfig field, the passes.

The compiled-model checks run ``inspect_only`` on real CPU tensors: Dynamo's capture, the split and the passes run
as in a real compile and the captured graph computes real numbers, with no Inductor code generation (seconds).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import sp_lab
from sp_lab.compiler import capture as capture_module
from sp_lab.compiler.artifact_cache import cache_dir, range_key
from sp_lab.compiler.capture import SharedCaptures, call_signature
from sp_lab.compiler.fake_inputs import TokenGuards
from sp_lab.compiler.ranges import CompileRange
from sp_lab.distributed.collectives import fake_process_group

TP = 2
CONFIG = sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=8, max_num_tokens=64)


# -- the call signature ------------------------------------------------------------------------------------------


def _sig(tokens: torch.Tensor, *args: Any, token_dim: int = 0, **kwargs: Any) -> tuple:
    return call_signature(tokens, token_dim, args, kwargs)


def test_the_token_count_alone_leaves_the_signature_unchanged():
    assert _sig(torch.ones(4, 8)) == _sig(torch.ones(13, 8))
    assert _sig(torch.ones(2, 4, 8), token_dim=1) == _sig(torch.ones(2, 9, 8), token_dim=1)
    assert _sig(torch.ones(4, 8), torch.ones(3), scale=2) == _sig(torch.ones(5, 8), torch.ones(3), scale=2)


@pytest.mark.parametrize("other", [
    pytest.param(torch.ones(4, 8, dtype=torch.bfloat16), id="dtype"),
    pytest.param(torch.ones(4, 9), id="hidden size"),
    pytest.param(torch.ones(4, 8, 1), id="rank"),
    pytest.param(torch.ones(4, 8, device="meta"), id="device"),
    pytest.param(torch.ones(4, 8, requires_grad=True), id="requires_grad"),
])
def test_the_token_tensor_is_keyed_by_everything_but_its_token_count(other):
    assert _sig(torch.ones(4, 8)) != _sig(other)


def test_a_batch_is_not_a_token_count_where_the_tokens_are_in_dim_1():
    assert _sig(torch.ones(2, 4, 8), token_dim=1) != _sig(torch.ones(3, 4, 8), token_dim=1)
    assert _sig(torch.ones(2, 4, 8), token_dim=0) == _sig(torch.ones(3, 4, 8), token_dim=0)


@pytest.mark.parametrize("args, kwargs, other_args, other_kwargs", [
    pytest.param((torch.ones(3),), {}, (torch.ones(4),), {}, id="another tensor's shape"),
    pytest.param((torch.ones(3),), {}, (torch.ones(3, dtype=torch.float64),), {}, id="another tensor's dtype"),
    pytest.param((torch.ones(3),), {}, (torch.ones(3, requires_grad=True),), {}, id="another tensor's grad"),
    pytest.param((2,), {}, (3,), {}, id="an int's value"),
    pytest.param((2,), {}, (2.0,), {}, id="an int or a float of one value"),
    pytest.param((True,), {}, (1,), {}, id="a bool or an int of one value"),
    pytest.param((), {"causal": True}, (), {"causal": False}, id="a keyword's value"),
    pytest.param((), {"a": 1}, (), {"b": 1}, id="a keyword's name"),
    pytest.param((1,), {}, (), {"a": 1}, id="positional or keyword"),
    pytest.param(((1, 2),), {}, ([1, 2],), {}, id="a tuple or a list"),
])
def test_other_arguments_are_keyed_by_their_shape_dtype_or_value(args, kwargs, other_args, other_kwargs):
    tokens = torch.ones(4, 8)
    assert call_signature(tokens, 0, args, kwargs) == call_signature(tokens, 0, args, dict(kwargs))
    assert call_signature(tokens, 0, args, kwargs) != call_signature(tokens, 0, other_args, other_kwargs)


def test_an_unhashable_argument_is_itself_only():
    tokens, layers = torch.ones(4, 8), {1, 3}  # a set: unhashable, and no pytree node (a dict's values are leaves)
    first = call_signature(tokens, 0, (layers,), {})
    assert first == call_signature(tokens, 0, (layers,), {})  # the same object: the same signature
    assert hash(first) == hash(call_signature(tokens, 0, (layers,), {}))
    assert first != call_signature(tokens, 0, ({1, 3},), {})  # an equal one: Dynamo may not have read it alike
    assert capture_module._Identity(layers) != layers


# -- shared captures: the token guards decide ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stub:
    """A stand-in for a Capture: only its token guards matter to ``find``."""

    token_guards: TokenGuards
    label: str


def _guards(expression: str) -> TokenGuards:
    import sympy

    n = sympy.Symbol("s0", integer=True, positive=True)
    return TokenGuards(n, (sympy.sympify(expression, locals={"s0": n}),))


def test_find_returns_only_a_capture_whose_guards_hold():
    model = torch.nn.Identity()
    shared = SharedCaptures(model)
    assert shared.model is model and len(shared) == 0  # sp_lab.compile refuses the captures of another model by it
    key = ("signature", None)
    large, small = _Stub(_guards("s0 > 8"), "large"), _Stub(_guards("s0 <= 8"), "small")
    shared.add(key, large)
    assert shared.find(key, 16) is large
    assert shared.find(key, 4) is None  # large's guards exclude 4: captured afresh, never run by large
    shared.add(key, small)
    assert shared.find(key, 4) is small and shared.find(key, 9) is large
    assert shared.find(("another signature", None), 16) is None
    assert len(shared) == 2
    unguarded = SharedCaptures(torch.nn.Identity())
    unguarded.add(key, _Stub(TokenGuards(), "static"))  # no symbol: serves every count
    assert unguarded.find(key, 1).label == "static"


def test_the_shared_key_names_the_process_group():
    signature = _sig(torch.ones(4, 8))
    assert SharedCaptures.key(signature) == (signature, None)  # no group initialised
    with fake_process_group(2):
        two = SharedCaptures.key(signature)
    with fake_process_group(4):
        four = SharedCaptures.key(signature)
    assert two[0] == four[0] == signature
    assert two != four and two[1][2] == 2 and four[1][2] == 4


class _Branchy(torch.nn.Module):
    """Dynamo's trace of it guards the token count: above 8 tokens one graph (x2), at 8 or fewer another (x3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 8 else x * 3


class _Typed(torch.nn.Module):
    """Reads its input's dtype (Dynamo bakes it into the graph as a constant), and casts nothing else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ones(x.shape[-1], dtype=x.dtype)


def test_a_variant_never_runs_another_variants_capture_whose_guards_fail():
    model = _Branchy()
    shared = SharedCaptures(model)
    with fake_process_group(TP):
        first = sp_lab.compile(model, CONFIG, captures=shared, inspect_only=True)
        second = sp_lab.compile(model, dataclasses.replace(CONFIG, boundary="gather"), captures=shared,
                                inspect_only=True)
        assert torch.equal(first(torch.ones(16, 4)), torch.full((16, 4), 2.0))
        assert torch.equal(second(torch.ones(4, 4)), torch.full((4, 4), 3.0))  # eager: 3.0 at 4 tokens
        assert torch.equal(second(torch.ones(12, 4)), torch.full((12, 4), 2.0))  # first's capture serves this one
        assert torch.equal(first(torch.ones(6, 4)), torch.full((6, 4), 3.0))  # and second's that one
    assert len(shared) == 2
    assert [g.shared_capture for g in first.report.graphs] == [False, True]
    assert [g.shared_capture for g in second.report.graphs] == [False, True]
    torch._dynamo.reset()


def test_one_compiled_model_called_in_two_dtypes_answers_in_each():
    model = _Typed()
    with fake_process_group(TP):
        compiled = sp_lab.compile(model, CONFIG, inspect_only=True)
        before = capture_module.counters["captures"]
        single = compiled(torch.ones(12, 4))
        half = compiled(torch.ones(12, 4, dtype=torch.bfloat16))
        again = compiled(torch.ones(10, 4))
        captured = capture_module.counters["captures"] - before
    assert single.dtype == torch.float32 and half.dtype == torch.bfloat16 and again.dtype == torch.float32
    assert torch.equal(half, torch.full((12, 4), 2.0, dtype=torch.bfloat16))
    assert captured == 2 and len(compiled.report.graphs) == 2  # one capture per dtype; 10 tokens reuse fp32's
    torch._dynamo.reset()


# -- the artifact cache's key --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(torch.nn.Linear(4, 4))


RANGE = CompileRange(8, 64, enable_sp=True, enable_async_tp=True)
EFFECTIVE = {"device": "cpu", "tp_size": 2, "backend": "gloo"}


def _key(graph: torch.fx.GraphModule, **changes: Any) -> str:
    args: dict[str, Any] = {"gm": graph, "example_inputs": [torch.empty(3, 4)], "config": CONFIG,
                            "effective": EFFECTIVE, "compile_range": RANGE, "pass_uuid": "pass-uuid", "hint": None}
    args.update(changes)
    hint = args.pop("hint")
    return range_key(*args.values(), hint=hint)


@pytest.mark.parametrize("change", [
    pytest.param({"compile_range": CompileRange(1, 7, enable_sp=True, enable_async_tp=True)}, id="range lo"),
    pytest.param({"compile_range": CompileRange(8, 128, enable_sp=True, enable_async_tp=True)}, id="range hi"),
    pytest.param({"compile_range": CompileRange(8, 64, enable_sp=False, enable_async_tp=True)}, id="range sp"),
    pytest.param({"compile_range": CompileRange(8, 64, enable_sp=True, enable_async_tp=False)}, id="range async_tp"),
    pytest.param({"example_inputs": [torch.empty(3, 4, dtype=torch.bfloat16)]}, id="input dtype"),
    pytest.param({"example_inputs": [torch.empty(3, 5)]}, id="input shape"),
    pytest.param({"example_inputs": [torch.empty(4, 3).t()]}, id="input stride"),
    pytest.param({"example_inputs": [torch.empty(3, 4, device="meta")]}, id="input device"),
    pytest.param({"example_inputs": [torch.empty(3, 4), 2]}, id="another input"),
    pytest.param({"example_inputs": [torch.empty(3, 4), 3]}, id="a non-tensor input's value"),
    pytest.param({"hint": 13}, id="trace hint"),
    pytest.param({"effective": {**EFFECTIVE, "tp_size": 4}}, id="tp"),
    pytest.param({"effective": {**EFFECTIVE, "device": "cuda:0"}}, id="device"),
    pytest.param({"effective": {**EFFECTIVE, "backend": "nccl"}}, id="backend"),
    pytest.param({"config": dataclasses.replace(CONFIG, tp_size=4)}, id="config tp"),
    pytest.param({"config": dataclasses.replace(CONFIG, async_tp_min_tokens=16)}, id="config threshold"),
    pytest.param({"config": dataclasses.replace(CONFIG, boundary="gather")}, id="config boundary"),
    pytest.param({"pass_uuid": "other-pass-uuid"}, id="passes"),
])
def test_the_range_key_changes_with_each_field_alone(graph, change):
    base = _key(graph)
    assert _key(graph) == base  # deterministic: everything else held
    assert _key(graph, **change) != base


def test_two_hints_and_no_hint_are_three_keys(graph):
    assert len({_key(graph), _key(graph, hint=12), _key(graph, hint=13)}) == 3


def test_the_range_key_changes_with_the_graph_and_the_versions(graph, monkeypatch):
    base = _key(graph)
    assert _key(torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))) != base
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert _key(graph) != base
    monkeypatch.undo()
    monkeypatch.setattr(sp_lab, "__version__", "0.0.0-other")
    assert _key(graph) != base
    monkeypatch.undo()


@pytest.mark.parametrize("other", ["DEFAULT", "AVX2", "AVX512"])
def test_the_range_key_changes_with_the_cpu_capability(graph, monkeypatch, other):
    """An entry holds kernel source generated for one ATen CPU capability; a process with another must not load it."""
    here = torch.backends.cpu.get_cpu_capability()
    base = _key(graph)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert (_key(graph) != base) == (other != here)


def test_a_dtensor_input_is_keyed_by_its_placements():
    from sp_lab.compiler.artifact_cache import _input_key

    plain = _input_key(torch.empty(3, 4))
    assert plain == ["tensor", ["3", "4"], ["4", "1"], "torch.float32", "cpu"]
    assert _input_key(7) == "7"
    with fake_process_group(2):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = init_device_mesh("cpu", (2,))
        local = torch.empty(3, 4)
        sharded = _input_key(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        replicated = _input_key(DTensor.from_local(local, mesh, [Replicate()], run_check=False))
    assert sharded[0] == "dtensor" and sharded[2] == plain and sharded != replicated


def test_the_key_ignores_the_order_of_a_dicts_items_and_reads_any_value(graph):
    # The effective config is a dict built by code that may list its items in another order; a value JSON cannot
    # write (a torch.device, a dtype) is keyed by its text rather than refused.
    assert _key(graph, effective=dict(reversed(EFFECTIVE.items()))) == _key(graph)
    typed = _key(graph, effective={**EFFECTIVE, "device": torch.device("cpu"), "dtype": torch.bfloat16})
    assert typed == _key(graph, effective={**EFFECTIVE, "device": "cpu", "dtype": "torch.bfloat16"})


def test_the_cache_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("SP_LAB_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("SP_LAB_CACHE_DIR", "off")
    assert cache_dir() is None
    monkeypatch.setenv("SP_LAB_CACHE_DIR", "")  # empty: not set
    assert cache_dir() is not None


@pytest.mark.parametrize("marks, where", [(("pyproject.toml", ".git"), "checkout"), (("pyproject.toml",), "home"),
                                          ((".git",), "home"), ((), "home")])
def test_without_the_variable_a_checkout_keeps_its_cache_inside_else_the_home(monkeypatch, tmp_path, marks, where):
    """sp_lab run from a checkout (a pyproject.toml and a .git beside sp_lab/) keeps the cache in it (git-ignored);
    an installed sp_lab (site-packages has neither) uses the home directory's."""
    from sp_lab.compiler import artifact_cache

    checkout = tmp_path / "checkout"
    (checkout / "sp_lab" / "compiler").mkdir(parents=True)
    for mark in marks:
        if mark == ".git":
            (checkout / mark).mkdir()
        else:
            (checkout / mark).write_text("")
    monkeypatch.delenv("SP_LAB_CACHE_DIR", raising=False)
    monkeypatch.setattr(artifact_cache, "__file__", str(checkout / "sp_lab" / "compiler" / "artifact_cache.py"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = (checkout if where == "checkout" else tmp_path / "home") / ".cache" / "sp_lab"
    assert cache_dir() == expected
