"""LabConfig validation, compile ranges, JSON / vLLM forms, and the effective-config check."""

import dataclasses
import itertools
import json

import pytest
import torch
import torch.distributed as dist

from sp_lab.config import ConfigError, LabConfig, load_tuned_config
from sp_lab.effective import EffectiveConfig, enable_sp_and_async_tp
from sp_lab.rules import MatmulRule
from sp_lab.tuning.export import export_tuned_config
from sp_lab.vllm_releases import vllm_sp_min_token_num

RULE = MatmulRule.from_dict(
    {
        "feature": "m",
        "threshold": 1024,
        "left": {"choice": "no_fuse", "confidence": 0.97, "samples": 12},
        "right": {"choice": "fuse", "confidence": 0.9, "samples": 20},
    }
)

# -- construction and validation ----------------------------------------------------------------------


def test_defaults():
    c = LabConfig()
    assert (c.tp_size, c.enable_sp, c.enable_async_tp, c.async_tp_min_tokens) == (2, True, True, 128)
    assert (
        c.compile_mode == "piecewise" and c.boundary == "sharded" and c.splitting_ops == ["sp_lab::attention"]
    )
    assert c.max_num_tokens == 16384 and c.cudagraphs is False and c.heuristic is None
    assert c.heuristic_default == "fuse" and c.notes() == []


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import sp_lab.config
    import sp_lab.effective

    for cls, module in ((LabConfig, sp_lab.config), (EffectiveConfig, sp_lab.effective)):
        tree = ast.parse(inspect.getsource(module))
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
        documented = {
            stmt.target.id
            for stmt, following in itertools.pairwise(body)
            if isinstance(stmt, ast.AnnAssign)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
        }
        assert documented == {f.name for f in dataclasses.fields(cls)}, cls.__name__


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"async_tp_min_tokens": "128"}, "async_tp_min_tokens: expected int, got str '128'"),
        ({"tp_size": 2.0}, "tp_size: expected int, got float 2.0"),
        ({"enable_sp": "yes"}, "enable_sp: expected bool, got str 'yes'"),
        ({"cudagraphs": 1}, "cudagraphs: expected bool, got int 1"),
        ({"max_num_tokens": True}, "max_num_tokens: expected int, got bool True"),
        ({"splitting_ops": "sp_lab::attention"}, "splitting_ops: expected list"),
        ({"splitting_ops": ["sp_lab::attention", 3]}, r"splitting_ops\[1\]: expected str, got int 3"),
        ({"compile_range_split_points": [512, "1024"]}, r"compile_range_split_points\[1\]: expected int"),
        ({"cudagraph_capture_sizes": [1, 2.5]}, r"cudagraph_capture_sizes\[1\]: expected int, got float 2.5"),
        ({"heuristic": {"choice": "fuse"}}, "heuristic: expected MatmulRule"),
        (
            {"compile_mode": "piecewse"},
            "compile_mode: expected one of 'piecewise', 'full_graph', got str 'piecewse'; did you mean 'piecewise'",
        ),
        ({"boundary": "gathered"}, "boundary: expected one of 'none', 'gather_erase', 'gather', 'sharded'"),
        (
            {"heuristic_default": "unsure"},
            "heuristic_default: expected one of 'fuse', 'no_fuse', got str 'unsure'",
        ),
        ({"tp_size": 0}, "tp_size: must be >= 1, got 0"),
        (
            {"enable_sp": False},
            "AsyncTP fuses the reduce_scatter/all_gather that SP creates: set enable_sp=True",
        ),
        ({"async_tp_min_tokens": 0}, r"async_tp_min_tokens: must be in \[1, max_num_tokens=16384\], got 0"),
        (
            {"async_tp_min_tokens": 20000},
            r"async_tp_min_tokens: must be in \[1, max_num_tokens=16384\], got 20000",
        ),
        ({"max_num_tokens": 0, "async_tp_min_tokens": 1}, "max_num_tokens: must be >= 1, got 0"),
        ({"splitting_ops": ["attention"]}, r"splitting_ops\[0\]: 'attention' is not a qualified op name"),
        ({"splitting_ops": ["sp_lab:attention"]}, r"splitting_ops\[0\]: 'sp_lab:attention'"),
        (
            {"compile_range_split_points": [1]},
            r"compile_range_split_points\[0\]: 1 is outside \(1, max_num_tokens",
        ),
        ({"compile_range_split_points": [16385]}, r"compile_range_split_points\[0\]: 16385 is outside"),
        ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes: empty list; use None"),
        ({"cudagraph_capture_sizes": [0, 8]}, r"cudagraph_capture_sizes\[0\]: 0 is outside"),
    ],
)
def test_validation_messages_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LabConfig(**kwargs)


def test_accepted_forms_are_normalised():
    c = LabConfig(
        compile_range_split_points=(4096, 1024, 1024),
        cudagraph_capture_sizes=[8, 1, 8],
        splitting_ops=("sp_lab::attention", "vllm::unified_attention", "aten::mm.default"),
    )
    assert c.compile_range_split_points == [1024, 4096]
    assert c.cudagraph_capture_sizes == [1, 8]
    assert isinstance(c.splitting_ops, list)
    assert LabConfig(enable_sp=False, enable_async_tp=False).enable_sp is False
    assert LabConfig(heuristic=RULE).heuristic == RULE


def test_notes_do_not_reject():
    c = LabConfig(compile_mode="full_graph", boundary="gather", splitting_ops=[])
    assert any("boundary='gather' has no effect" in n for n in c.notes())
    assert any("splitting_ops are ignored" in n for n in c.notes())
    assert LabConfig(compile_mode="full_graph").notes() == []
    assert any("one piece" in n for n in LabConfig(splitting_ops=[]).notes())
    assert LabConfig(heuristic=RULE, enable_async_tp=False).notes() == [
        "heuristic is unused: enable_async_tp=False"
    ]
    assert LabConfig(cudagraph_capture_sizes=[1]).notes() == [
        "cudagraph_capture_sizes is unused: cudagraphs=False"
    ]


# -- compile ranges ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, [(1, 127), (128, 16384)]),
        ({"async_tp_min_tokens": 1}, [(1, 16384)]),
        ({"async_tp_min_tokens": 16384}, [(1, 16383), (16384, 16384)]),
        ({"compile_range_split_points": [1024, 8192]}, [(1, 127), (128, 1023), (1024, 8191), (8192, 16384)]),
        ({"compile_range_split_points": [64, 128]}, [(1, 63), (64, 127), (128, 16384)]),
        ({"compile_range_split_points": [16384]}, [(1, 127), (128, 16383), (16384, 16384)]),
        ({"max_num_tokens": 256, "async_tp_min_tokens": 2}, [(1, 1), (2, 256)]),
        ({"enable_sp": False, "enable_async_tp": False}, [(1, 127), (128, 16384)]),
    ],
)
def test_compile_ranges(kwargs, expected):
    c = LabConfig(**kwargs)
    ranges = c.compile_ranges()
    assert ranges == expected
    # Contiguous and complete: every token count has exactly one range.
    assert ranges[0][0] == 1 and ranges[-1][1] == c.max_num_tokens
    assert all(hi + 1 == lo for (_, hi), (lo, _) in itertools.pairwise(ranges))
    for lo, hi in ranges:
        assert c.range_for(lo) == (lo, hi) == c.range_for(hi)


def test_range_for_and_sp_active_for():
    c = LabConfig(compile_range_split_points=[1024])
    assert (
        c.range_for(1) == (1, 127) and c.range_for(128) == (128, 1023) and c.range_for(16384) == (1024, 16384)
    )
    assert [c.sp_active_for(r) for r in c.compile_ranges()] == [False, True, True]
    assert [c.async_tp_active_for(r) for r in c.compile_ranges()] == [False, True, True]
    sp_only = LabConfig(enable_async_tp=False)
    assert [sp_only.async_tp_active_for(r) for r in sp_only.compile_ranges()] == [False, False]
    assert [sp_only.sp_active_for(r) for r in sp_only.compile_ranges()] == [False, True]
    off = LabConfig(enable_sp=False, enable_async_tp=False)
    assert not any(off.sp_active_for(r) for r in off.compile_ranges())
    with pytest.raises(ValueError, match="num_tokens=16385 exceeds max_num_tokens=16384"):
        c.range_for(16385)
    with pytest.raises(ValueError, match="num_tokens=0: a call needs at least 1 token"):
        c.range_for(0)
    with pytest.raises(TypeError, match="num_tokens: expected int"):
        c.range_for(3.0)
    with pytest.raises(ValueError, match=r"straddles async_tp_min_tokens=128"):
        c.sp_active_for((64, 256))


def test_capture_sizes():
    assert LabConfig().resolved_capture_sizes() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert LabConfig(max_num_tokens=100, async_tp_min_tokens=64).resolved_capture_sizes() == [
        1,
        2,
        4,
        8,
        16,
        32,
        64,
    ]
    assert LabConfig(cudagraph_capture_sizes=[3, 5]).resolved_capture_sizes() == [3, 5]


# -- serialisation -------------------------------------------------------------------------------------


def _configs():
    return [
        LabConfig(),
        LabConfig(tp_size=8, async_tp_min_tokens=2048, heuristic=RULE, heuristic_default="no_fuse"),
        LabConfig(
            compile_mode="full_graph", splitting_ops=[], cudagraphs=True, cudagraph_capture_sizes=[1, 8]
        ),
        LabConfig(
            enable_sp=False, enable_async_tp=False, boundary="gather_erase", compile_range_split_points=[512]
        ),
    ]


@pytest.mark.parametrize("config", _configs())
def test_round_trips(config, tmp_path):
    assert LabConfig.from_dict(config.to_dict()) == config
    assert LabConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert LabConfig.from_json(config.to_json()) == config
    assert LabConfig.from_json(json.dumps(config.to_dict())) == config  # a bare dict of fields
    path = tmp_path / "c.json"
    text = config.to_json(path, provenance={"device": "cpu"})
    assert path.read_text() == text
    assert LabConfig.from_json(path) == config and LabConfig.from_json(str(path)) == config
    loaded, provenance = load_tuned_config(path)
    assert loaded == config and provenance == {"device": "cpu"}


def test_file_layout():
    doc = json.loads(LabConfig(heuristic=RULE).to_json())
    assert list(doc) == ["schema", "vllm", "sp_lab"]
    assert doc["schema"] == "sp_lab.config/1"
    assert doc["sp_lab"]["heuristic"]["tree"]["threshold"] == 1024
    assert doc["vllm"]["release"] == "0.34.0" and "not_expressible" in doc["vllm"]  # newest: no SP pass
    on_031 = json.loads(LabConfig(heuristic=RULE).to_json(vllm_release="0.31"))["vllm"]
    assert on_031["release"] == "0.31.0" and on_031["compilation_config"]["pass_config"] == {
        "enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": 128}
    assert "per-matmul fusion rule stays in the sp_lab section" in on_031["notes"][0]


def test_from_dict_errors():
    with pytest.raises(ConfigError, match="unknown field 'enable_asynctp'; did you mean 'enable_async_tp'"):
        LabConfig.from_dict({"enable_asynctp": True})
    with pytest.raises(ConfigError, match="unknown field 'xyz'; known fields: tp_size, enable_sp"):
        LabConfig.from_dict({"xyz": 1})
    with pytest.raises(ConfigError, match="async_tp_min_tokens: expected int, got str '128'"):
        LabConfig.from_json('{"async_tp_min_tokens": "128"}')
    with pytest.raises(ConfigError, match=r"heuristic: root.right.choice: expected one of"):
        LabConfig.from_dict(
            {
                "heuristic": {
                    "feature": "m",
                    "threshold": 1,
                    "left": {"choice": "fuse"},
                    "right": {"choice": "always"},
                }
            }
        )
    with pytest.raises(ConfigError, match="expected a dict of fields, got list"):
        LabConfig.from_dict([])


def test_from_json_file_errors(tmp_path):
    doc = json.loads(LabConfig().to_json(vllm_release="0.31"))
    with pytest.raises(ConfigError, match="schema: expected 'sp_lab.config/1', got 'sp_lab.config/9'"):
        LabConfig.from_json(json.dumps({**doc, "schema": "sp_lab.config/9"}))
    with pytest.raises(ConfigError, match=r"unknown top-level keys \['vlm'\]"):
        LabConfig.from_json(json.dumps({**doc, "vlm": {}}))
    with pytest.raises(ConfigError, match="sp_lab: missing"):
        LabConfig.from_json(json.dumps({"schema": "sp_lab.config/1"}))
    doc["vllm"]["compilation_config"]["pass_config"]["sp_min_token_num"] = 2048
    with pytest.raises(
        ConfigError,
        match="vllm.compilation_config.pass_config.sp_min_token_num: the file says 2048 but its sp_lab "
        "section gives 128",
    ):
        LabConfig.from_json(json.dumps(doc))
    doc["sp_lab"]["enable_async_tp"] = "true"
    with pytest.raises(ConfigError, match="enable_async_tp: expected bool, got str 'true'"):
        LabConfig.from_json(json.dumps(doc))
    with pytest.raises(ConfigError, match="not valid JSON"):
        LabConfig.from_json("{oops")
    with pytest.raises(FileNotFoundError, match="no such config file"):
        LabConfig.from_json(tmp_path / "missing.json")


def test_vllm_section_of_an_older_file_is_not_checked():
    doc = json.loads(LabConfig().to_json())
    doc["vllm"] = {"pass_config": {"enable_sp": True}, "splitting_ops": ["sp_lab::attention"]}
    assert LabConfig.from_json(json.dumps(doc)) == LabConfig()


def test_sp_min_tokens_gates_sp_before_async_tp():
    config = LabConfig(sp_min_tokens=16, async_tp_min_tokens=256, max_num_tokens=1024)
    assert config.compile_ranges() == [(1, 15), (16, 255), (256, 1024)]
    assert [config.sp_active_for(r) for r in config.compile_ranges()] == [False, True, True]
    assert [config.async_tp_active_for(r) for r in config.compile_ranges()] == [False, False, True]
    with pytest.raises(ValueError, match="straddles sp_min_tokens=16"):
        config.sp_active_for((8, 32))
    with pytest.raises(ConfigError, match=r"sp_min_tokens: must be in \[1, async_tp_min_tokens=256\], got 512"):
        LabConfig(sp_min_tokens=512, async_tp_min_tokens=256)
    assert LabConfig.from_json(config.to_json()) == config


def test_export_tuned_config(tmp_path):
    config = LabConfig(async_tp_min_tokens=1024, heuristic=RULE)
    spec = {"name": "llama-3-8b", "hidden_size": 4096, "num_layers": 32}
    path = export_tuned_config(
        config,
        directory=tmp_path / "configs",
        device_name="NVIDIA H200",
        model_spec=spec,
        dtype=torch.bfloat16,
        data_hash="abc123",
        extra_provenance={"rows": 480},
    )
    assert path.name == "device_name=NVIDIA_H200,tp=2,model=llama-3-8b,dtype=bfloat16.json"
    loaded, provenance = load_tuned_config(path)
    assert loaded == config
    assert (
        provenance["device"] == "NVIDIA H200" and provenance["tp_size"] == 2 and provenance["model"] == spec
    )
    assert provenance["dtype"] == "bfloat16" and provenance["torch"] == torch.__version__
    assert provenance["data_hash"] == "abc123" and provenance["rows"] == 480 and "created_utc" in provenance
    assert "compile passes" in json.loads(path.read_text())["vllm"]["not_expressible"]  # newest: passes removed
    on_031 = export_tuned_config(config, directory=tmp_path / "031", device_name="cpu", model_spec=spec,
                                 dtype="float32", data_hash="x", vllm_release="0.31.0")
    assert json.loads(on_031.read_text())["vllm"]["compilation_config"]["pass_config"]["sp_min_token_num"] == 1024
    hf = export_tuned_config(
        config,
        directory=tmp_path,
        device_name="cpu",
        model_spec={"name": "meta-llama/L 3"},
        dtype="float32",
        data_hash="x",
    )
    assert hf.name == "device_name=cpu,tp=2,model=meta-llama_L_3,dtype=float32.json"
    with pytest.raises(ConfigError, match="extra_provenance: keys \\['device'\\]"):
        export_tuned_config(
            config,
            directory=tmp_path,
            device_name="cpu",
            model_spec=spec,
            dtype="float32",
            data_hash="x",
            extra_provenance={"device": "gpu"},
        )
    with pytest.raises(ConfigError, match="model_spec: expected a dict with a 'name'"):
        export_tuned_config(
            config, directory=tmp_path, device_name="cpu", model_spec={}, dtype="float32", data_hash="x"
        )


def test_vllm_sp_min_token_num():
    # vLLM 0.21-0.31 sequence_parallelism.py: 8 MiB per GPU on sm90, 32 on sm100, hidden >= 8192.
    # Llama-70B (hidden 8192) bf16 on Hopper.
    assert [vllm_sp_min_token_num(8192, 2, tp) for tp in (2, 4, 8)] == [1024, 2048, 4096]
    assert vllm_sp_min_token_num(8192, 2, 8, device_capability=(10, 0)) == 16384  # 32 MiB on Blackwell
    assert vllm_sp_min_token_num(8192, 1, 2) == 2048  # fp8 activations: half the bytes, twice the tokens
    assert vllm_sp_min_token_num(4096, 2, 2) is None  # hidden < 8192: SP off
    assert vllm_sp_min_token_num(8192, 2, 2, device_capability=(8, 0)) is None
    assert vllm_sp_min_token_num(8192, 2, 8, device_capability=(10, 0), version="0.20") is None  # sm90 only then
    with pytest.raises(ValueError, match="0.34.0 has no sp_min_token_num default"):
        vllm_sp_min_token_num(8192, 2, 8, version="0.34")


# -- effective config ----------------------------------------------------------------------------------


def _assert_every_drop_has_a_reason(config: LabConfig, eff: EffectiveConfig):
    for name in ("enable_sp", "enable_async_tp", "cudagraphs"):
        if getattr(config, name) and not getattr(eff, name):
            assert any(r.startswith(f"{name}: ") for r in eff.reasons), (name, eff.reasons)


def test_effective_tp1_without_group():
    assert not dist.is_initialized()
    config = LabConfig(tp_size=1, cudagraphs=True)
    eff = enable_sp_and_async_tp(config)
    assert (eff.enable_sp, eff.enable_async_tp, eff.backend, eff.tp_size) == (False, False, "none", 1)
    assert "enable_sp: tp_size 1: no collectives to rewrite" in eff.reasons
    assert "enable_async_tp: tp_size 1: no collectives to rewrite" in eff.reasons
    if torch.cuda.is_available():
        assert eff.cudagraphs and eff.device.startswith("cuda:")
    else:
        assert eff.cudagraphs is False and any(
            r.startswith("cudagraphs: CUDA is not available") for r in eff.reasons
        )
    _assert_every_drop_has_a_reason(config, eff)
    assert eff.to_dict()["reasons"] == eff.reasons and json.dumps(eff.to_dict())


def test_effective_without_group():
    config = LabConfig(tp_size=4)
    eff = enable_sp_and_async_tp(config)
    assert not eff.enable_sp and not eff.enable_async_tp and eff.fused_op_impl == "none"
    assert any("no process group is initialised (tp_size=4 requested)" in r for r in eff.reasons)
    _assert_every_drop_has_a_reason(config, eff)
    with pytest.raises(ConfigError, match="torch.distributed is not initialised"):
        enable_sp_and_async_tp(config, group=object())


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_effective_fake_group(fake_group):
    config = LabConfig(tp_size=4, compile_mode="full_graph", boundary="gather")
    eff = enable_sp_and_async_tp(config)
    assert eff.enable_sp and eff.enable_async_tp and eff.backend == "fake" and eff.tp_size == 4
    assert eff.fused_op_impl == "cpu_chunked" and not eff.symm_mem
    assert any("placeholder data" in r for r in eff.reasons)
    assert eff.notes == config.notes() != []
    assert enable_sp_and_async_tp(config, group=fake_group).to_dict() == eff.to_dict()
    sp_only = enable_sp_and_async_tp(LabConfig(tp_size=4, enable_async_tp=False))
    assert sp_only.enable_sp and not sp_only.enable_async_tp and sp_only.fused_op_impl == "none"
    with pytest.raises(ConfigError, match="config asks for 2 ranks but the process group has 4"):
        enable_sp_and_async_tp(LabConfig(tp_size=2))


def test_effective_gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = LabConfig(tp_size=1)
        eff = enable_sp_and_async_tp(config)
        assert eff.backend == "gloo" and eff.device == "cpu" and not eff.enable_sp
        assert "enable_sp: tp_size 1: no collectives to rewrite" in eff.reasons
        _assert_every_drop_has_a_reason(config, eff)
    finally:
        dist.destroy_process_group()


def _effective_on_rank(config_dict):
    return enable_sp_and_async_tp(LabConfig.from_dict(config_dict)).to_dict()


def test_effective_gloo_two_ranks():
    from sp_lab import launch

    config = LabConfig(tp_size=2, cudagraphs=True)
    results = launch(_effective_on_rank, config.to_dict(), world_size=2, backend="gloo", timeout=120)
    assert results[0] == results[1]
    eff = EffectiveConfig(**results[0])
    assert eff.backend == "gloo" and eff.tp_size == 2 and eff.enable_sp and eff.enable_async_tp
    assert eff.fused_op_impl == "cpu_chunked" and not eff.symm_mem and not eff.cudagraphs
    assert any("correctness path" in r for r in eff.reasons)
    _assert_every_drop_has_a_reason(config, eff)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for an NCCL group")
def test_effective_nccl_world_of_one(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        config = LabConfig(tp_size=1, cudagraphs=True)
        eff = enable_sp_and_async_tp(config)
        assert (eff.backend, eff.device, eff.cudagraphs, eff.tp_size) == ("nccl", "cuda:0", True, 1)
        assert not eff.enable_sp and not eff.symm_mem and eff.fused_op_impl == "none"
        _assert_every_drop_has_a_reason(config, eff)
    finally:
        dist.destroy_process_group()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for an NCCL group")
def test_effective_nccl_two_ranks():
    from sp_lab import launch

    config = LabConfig(tp_size=2, cudagraphs=True)
    results = launch(_effective_on_rank, config.to_dict(), world_size=2, backend="nccl", timeout=300)
    eff = EffectiveConfig(**results[0])
    assert eff.backend == "nccl" and eff.device == "cuda:0" and eff.cudagraphs
    assert EffectiveConfig(**results[1]).device == "cuda:1"
    # Either symmetric memory is on and AsyncTP uses it, or AsyncTP is dropped and says why.
    assert eff.enable_async_tp == eff.symm_mem == (eff.fused_op_impl == "symm_mem")
    _assert_every_drop_has_a_reason(config, eff)


def test_docstring_examples():
    import doctest
    import inspect

    import sp_lab.config

    results = doctest.testmod(sp_lab.config)
    # Every example in the source ran (a docstring doctest does not collect would pass unseen), none failed.
    examples = sum(line.lstrip().startswith(">>> ") for line in inspect.getsource(sp_lab.config).splitlines())
    assert results.attempted == examples > 0 and results.failed == 0, (results, examples)
