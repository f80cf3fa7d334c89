"""LabConfig at the edges of its ranges, the messages a user reads, and the checks of its JSON and vLLM forms.

Pure Python (no torch, no process group): the inclusive ends of every accepted range, the text of each error
(the field, the bad value, what would work), what ``to_vllm`` gives and refuses, and the file checks of
:func:`load_tuned_config` (a hand-edited ``vllm`` section, a malformed file)."""

import json

import pytest

from sp_lab.config import BoundaryStrategy, ConfigError, LabConfig, load_tuned_config

# -- accepted ranges: both ends are valid --------------------------------------------------------------------


def test_a_one_token_config_is_valid():
    c = LabConfig(max_num_tokens=1, async_tp_min_tokens=1)
    assert c.compile_ranges() == [(1, 1)] and c.range_for(1) == (1, 1)
    assert c.resolved_capture_sizes() == [1]


def test_sp_min_tokens_may_be_one_or_equal_async_tp_min_tokens():
    everywhere = LabConfig(sp_min_tokens=1, async_tp_min_tokens=256, max_num_tokens=1024)
    assert everywhere.compile_ranges() == [(1, 255), (256, 1024)]
    assert [everywhere.sp_active_for(r) for r in everywhere.compile_ranges()] == [True, True]
    assert [everywhere.async_tp_active_for(r) for r in everywhere.compile_ranges()] == [False, True]
    together = LabConfig(sp_min_tokens=256, async_tp_min_tokens=256, max_num_tokens=1024)
    assert together.compile_ranges() == LabConfig(async_tp_min_tokens=256, max_num_tokens=1024).compile_ranges()
    assert [together.sp_active_for(r) for r in together.compile_ranges()] == [False, True]


def test_split_point_two_and_capture_size_max_num_tokens_are_valid():
    c = LabConfig(compile_range_split_points=[2], cudagraphs=True, cudagraph_capture_sizes=[1, 1024],
                  max_num_tokens=1024)
    assert c.compile_ranges() == [(1, 1), (2, 127), (128, 1024)]
    assert c.resolved_capture_sizes() == [1, 1024]


def test_default_capture_ladder_reaches_max_num_tokens():
    assert LabConfig(max_num_tokens=512).resolved_capture_sizes() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert LabConfig(max_num_tokens=511).resolved_capture_sizes()[-1] == 256


def test_cudagraphs_alone_means_piecewise_graphs():
    c = LabConfig(cudagraphs=True)
    assert c.cudagraph_mode == "piecewise"
    assert c == LabConfig(cudagraph_mode="piecewise") == LabConfig.from_dict(c.to_dict())
    sp_off = LabConfig(cudagraphs=True, enable_sp=False, enable_async_tp=False)
    assert sp_off.to_vllm("0.31")["cudagraph_mode"] == "PIECEWISE"
    assert LabConfig().cudagraph_mode == "none" and LabConfig(cudagraph_mode="full").cudagraphs is True


# -- the messages a user reads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"token_dim": -1}, "token_dim: must be >= 0 (a dimension of the model input), got -1"),
        (
            {"splitting_ops": ["sp_lab::attention", "attention"]},
            ("splitting_ops[1]: 'attention' is not a qualified op name 'namespace::name' "
            "(e.g. 'sp_lab::attention', 'vllm::unified_attention')"),
        ),
        (
            {"compile_range_split_points": [64, 1], "max_num_tokens": 512},
            ("compile_range_split_points[1]: 1 is outside (1, max_num_tokens=512]; "
            "a split point p starts the range [p, ...], so it must be in 2..max_num_tokens"),
        ),
        (
            {"cudagraphs": True, "cudagraph_mode": "none"},
            ("cudagraphs=True contradicts cudagraph_mode='none': set cudagraph_mode to 'piecewise', 'full' or "
            "'full_and_piecewise' (cudagraphs then follows it), or cudagraphs=False"),
        ),
        (
            {"cudagraph_capture_sizes": []},
            "cudagraph_capture_sizes: empty list; use None for the default ladder or cudagraphs=False",
        ),
        (
            {"cudagraph_capture_sizes": [8, 600], "max_num_tokens": 512},
            "cudagraph_capture_sizes[1]: 600 is outside [1, max_num_tokens=512]",
        ),
    ],
)
def test_value_errors_read_as_written(kwargs, message):
    with pytest.raises(ConfigError) as err:
        LabConfig(**kwargs)
    assert str(err.value) == message


def test_an_unknown_boundary_strategy_lists_the_known_ones():
    assert BoundaryStrategy("gather") is BoundaryStrategy.GATHER
    with pytest.raises(ConfigError) as err:
        BoundaryStrategy("gathered")
    assert str(err.value) == "boundary: unknown strategy 'gathered'; choose from none, gather_erase, gather, sharded"
    assert BoundaryStrategy.names() == "none, gather_erase, gather, sharded"


def test_notes_read_as_written():
    assert LabConfig(compile_mode="full_graph", boundary="gather", splitting_ops=["vllm::unified_attention"]).notes() == [
        "boundary='gather' has no effect with compile_mode='full_graph': there are no piece boundaries",
        "splitting_ops are ignored with compile_mode='full_graph'",
    ]
    assert LabConfig(splitting_ops=[]).notes() == [
        "splitting_ops is empty: compile_mode='piecewise' compiles one piece, as 'full_graph'"
    ]
    # SP alone (AsyncTP off) without a rule is a plain valid config: nothing to note.
    assert LabConfig(enable_async_tp=False).notes() == []


# -- token counts and ranges -------------------------------------------------------------------------------------


def test_num_tokens_multiplies_up_to_token_dim():
    assert LabConfig().num_tokens((8, 16)) == 8  # [N, H]: N tokens
    assert LabConfig(token_dim=1).num_tokens((2, 64, 4096)) == 128  # [batch, seq, H]
    with pytest.raises(ValueError) as err:
        LabConfig(token_dim=1).num_tokens((64,))
    assert str(err.value) == (
        "token_dim=1 but the first argument has shape (64,): set LabConfig.token_dim to the dimension that "
        "holds the tokens (0 for [N] / [N, H], 1 for [batch, N])"
    )


def test_range_for_errors_name_the_value_and_the_fix():
    c = LabConfig(max_num_tokens=1024)
    with pytest.raises(TypeError) as err:
        c.range_for(3.0)
    assert str(err.value) == "num_tokens: expected int, got float 3.0"
    with pytest.raises(ValueError) as err:
        c.range_for(1025)
    assert str(err.value) == (
        "num_tokens=1025 exceeds max_num_tokens=1024: raise LabConfig.max_num_tokens or split the batch"
    )


def test_a_range_that_ends_at_a_gate_straddles_it():
    c = LabConfig(sp_min_tokens=16, async_tp_min_tokens=128, max_num_tokens=1024)
    with pytest.raises(ValueError, match=r"compile range \(64, 128\) straddles async_tp_min_tokens=128"):
        c.async_tp_active_for((64, 128))
    with pytest.raises(ValueError, match=r"compile range \(8, 16\) straddles sp_min_tokens=16"):
        c.sp_active_for((8, 16))
    assert c.sp_active_for((16, 127)) and not c.async_tp_active_for((16, 127))


# -- dict, JSON and vLLM forms -------------------------------------------------------------------------------------


def test_to_dict_is_a_copy():
    c = LabConfig(compile_range_split_points=[1024], cudagraph_capture_sizes=[1, 8])
    d = c.to_dict()
    d["splitting_ops"].append("vllm::unified_attention")
    d["compile_range_split_points"].append(2048)
    d["cudagraph_capture_sizes"].clear()
    assert c == LabConfig(compile_range_split_points=[1024], cudagraph_capture_sizes=[1, 8])


def test_to_vllm():
    assert LabConfig(async_tp_min_tokens=256).to_vllm("0.31") == {
        "mode": 3,
        "pass_config": {"enable_sp": True, "fuse_gemm_comms": True, "sp_min_token_num": 256},
        "splitting_ops": [],
        "compile_ranges_endpoints": [255],
        "cudagraph_mode": "NONE",
    }
    with pytest.raises(ConfigError) as err:
        LabConfig(sp_min_tokens=16, async_tp_min_tokens=256).to_vllm("0.31")
    assert str(err.value) == (
        "to_vllm: SP starts at 16 tokens and AsyncTP at 256, but vLLM fuses GEMMs with collectives wherever SP "
        "runs (one gate for both); the closest vLLM 0.31.0 can run: never, always"
    )


def test_an_unknown_vllm_release_is_a_config_error():
    message = r"^vLLM release: unknown vLLM release '0\.1': the release table has no 0\.1; supported: 0\.11"
    with pytest.raises(ConfigError, match=message):
        LabConfig().to_vllm("0.1")
    with pytest.raises(ConfigError, match=message):
        LabConfig().to_json(vllm_release="0.1")


def test_file_is_two_space_indented_json_ending_in_a_newline():
    # Tuned configs are read and diffed by people: one key per line, indented by two spaces.
    text = LabConfig().to_json()
    assert text.endswith("}\n") and text.splitlines()[:2] == ["{", '  "schema": "sp_lab.config/1",']


def test_to_json_refuses_unknown_sections():
    with pytest.raises(ConfigError) as err:
        LabConfig().to_json(sections={"model_sp": {}, "tuning": {}})
    assert str(err.value) == (
        "sections: ['tuning'] are not sections of the file; known: ('vllm', 'model_sp', 'torch_compile', 'serving')"
    )
    doc = json.loads(LabConfig().to_json(sections={"model_sp": {"rows": 3}}))
    assert doc["model_sp"] == {"rows": 3} and load_tuned_config(json.dumps(doc)) == (LabConfig(), {})


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "config: expected a JSON object, got list"),
        (
            json.dumps({"schema": "sp_lab.config/1", "sp_lab": {}, "provenance": ["cpu"]}),
            "provenance: expected a dict, got list",
        ),
        (
            json.dumps({"schema": "sp_lab.config/1", "sp_lab": {}, "notes": []}),
            ("unknown top-level keys ['notes']; expected schema, sp_lab, provenance, vllm, model_sp, torch_compile, "
            "serving"),
        ),
        (json.dumps({"schema": "sp_lab.config/1"}), "sp_lab: missing; the 'sp_lab' section holds the LabConfig fields"),
        (json.dumps({"heuristic": 3}), "heuristic: expected a MatmulRule or its JSON object, got int 3"),
    ],
)
def test_malformed_files_read_as_written(text, message):
    with pytest.raises(ConfigError) as err:
        load_tuned_config(text)
    assert str(err.value) == message


def _edited(vllm_release: str, edit) -> str:
    doc = json.loads(LabConfig().to_json(vllm_release=vllm_release))
    edit(doc["vllm"])
    return json.dumps(doc)


@pytest.mark.parametrize(
    "release, edit, message",
    [
        (  # a key the sp_lab section does not give
            "0.31",
            lambda v: v["compilation_config"]["pass_config"].update(fuse_norm_quant=True),
            ("vllm.compilation_config.pass_config.fuse_norm_quant: the file says True but its sp_lab section gives "
            "None"),
        ),
        (  # a key it gives, deleted
            "0.31",
            lambda v: v["compilation_config"].pop("compile_ranges_endpoints"),
            "vllm.compilation_config.compile_ranges_endpoints: the file says None but its sp_lab section gives [127]",
        ),
        (  # the whole object replaced by null
            "0.31",
            lambda v: v.update(compilation_config=None),
            ("vllm.compilation_config: the file says None but its sp_lab section gives {'mode': 3, 'pass_config': "
            "{'enable_sp': True, 'fuse_gemm_comms': True, 'sp_min_token_num': 128}, 'splitting_ops': [], "
            "'compile_ranges_endpoints': [127], 'cudagraph_mode': 'NONE'}"),
        ),
        (  # a release that cannot run the policy: its reason is derived too
            "0.34",
            lambda v: v.update(not_expressible="edited"),
            "vllm.not_expressible: the file says 'edited' but its sp_lab section gives 'vLLM 0.34.0 removed",
        ),
    ],
)
def test_an_edited_vllm_section_is_refused(release, edit, message):
    with pytest.raises(ConfigError) as err:
        load_tuned_config(_edited(release, edit))
    assert str(err.value).startswith(message)
    assert str(err.value).endswith(
        "; the vllm section is derived from sp_lab -- edit the sp_lab section (or delete the vllm section)"
    )


def test_a_range_that_ends_before_it_starts_is_refused_naming_the_ranges_there_are():
    config = LabConfig(async_tp_min_tokens=256, max_num_tokens=8192)
    for active in (config.sp_active_for, config.async_tp_active_for):
        with pytest.raises(ValueError, match=r"compile range \(300, 100\) ends before it starts; use a range from "
                                             r"compile_ranges\(\): \[\(1, 255\), \(256, 8192\)\]"):
            active((300, 100))

