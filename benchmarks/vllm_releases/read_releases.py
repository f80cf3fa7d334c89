"""Read what each vLLM release does with a ``--compilation-config`` from its own wheel; write the release table.

    python benchmarks/vllm_releases/read_releases.py 0.11.0 0.11.1 ... 0.34.0 > data/vllm/releases.json

For each version: ``pip download --no-deps vllm==X``, unzip the few Python files read here into a temporary
directory, delete the wheel, then

- import ``vllm/config/compilation.py`` on CPU (pydantic and torch; tiny stand-ins for ``vllm.logger`` and
  ``vllm.platforms`` are written into the temporary directory, nothing of vLLM is kept) and read the
  ``CompilationConfig`` / ``PassConfig`` fields a user may set, the ``CUDAGraphMode`` names, and whether an
  unknown key is rejected or dropped (``TypeAdapter(CompilationConfig).validate_json``, as ``vllm serve``
  parses ``--compilation-config``);
- parse (not run) the SP pass, the compile-range code and the model-level SP helpers to say what gates SP.

Each fact is written with the file it was read from. Needs network access to the package index and ~1 GB
of free disk per wheel while it is unpacked.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

READ = ("vllm/config/", "vllm/compilation/", "vllm/models/common/ops/sequence_parallel.py", "vllm/envs.py",
        "vllm/utils/")
SP_PASS_FILES = ("vllm/compilation/sequence_parallelism.py", "vllm/compilation/passes/fusion/sequence_parallelism.py")
STUBS = {
    "vllm/logger.py": "import logging\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/platforms/__init__.py": "class _P:\n    def __getattr__(self, k):\n        return lambda *a, **kw: False\n"
                                  "current_platform = _P()\n",
}


def unpack(version: str, into: Path, prefixes: tuple[str, ...] = READ) -> tuple[str, str]:
    """Unzip the Python files under ``prefixes`` from vLLM ``version``'s wheel into ``into``; return the wheel's
    name and its sha256 (what a reader can check the facts against: ``pip download`` the same wheel)."""
    dl = into / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                    f"vllm=={version}", "-d", str(dl)], check=True)
    (wheel,) = dl.glob("*.whl")
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(".py") and name.startswith(prefixes):
                z.extract(name, into)
    wheel.unlink()  # wheels are hundreds of MB: keep only the sources read
    return wheel.name, digest.hexdigest()


def import_compilation(root: Path) -> types.ModuleType:
    """``vllm.config.compilation`` from ``root`` without running ``vllm/__init__`` or ``vllm/config/__init__``."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    for rel, text in STUBS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)

    def package(name: str) -> None:
        module = types.ModuleType(name)
        module.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = module

    for name in ("vllm", "vllm.config", "vllm.compilation", "vllm.compilation.passes"):
        package(name)
    if (root / "vllm/utils/__init__.py").exists():  # 0.11-0.12: helpers live in vllm/utils/__init__.py,
        # which imports half of vLLM; compilation.py needs two of them
        import torch
        from packaging.version import Version

        utils = types.ModuleType("vllm.utils")
        utils.__path__ = [str(root / "vllm/utils")]
        utils.is_torch_equal_or_newer = lambda v: Version(torch.__version__.split("+")[0]) >= Version(v)
        utils.resolve_obj_by_qualname = lambda q: getattr(importlib.import_module(q.rsplit(".", 1)[0]),
                                                          q.rsplit(".", 1)[1])
        sys.modules["vllm.utils"] = utils
    else:
        package("vllm.utils")
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("vllm.config.compilation")
    finally:
        sys.path.remove(str(root))


def user_fields(cls: type) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if f.init]


def unknown_keys(module: types.ModuleType) -> str:
    from pydantic import TypeAdapter

    try:
        TypeAdapter(module.CompilationConfig).validate_json('{"pass_config": {"no_such_field": 1}}')
    except Exception as e:  # noqa: BLE001  (pydantic.ValidationError, imported with the release's pydantic)
        assert "Unexpected keyword argument" in str(e) or "extra" in str(e), e
        return "rejected"
    return "dropped"


def method_source(path: Path, prefix: str) -> tuple[str, str] | None:
    """(name, source) of the first method named ``prefix*`` in ``path``'s SequenceParallelismPass."""
    tree = ast.parse(path.read_text())
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name == "SequenceParallelismPass":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name.startswith(prefix):
                    return fn.name, ast.get_source_segment(path.read_text(), fn)
    return None


def module_constant(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(node.value)
    return None


def sp_facts(root: Path, pass_fields: list[str]) -> dict:
    """What gates SP in this release, read from its SP pass and compilation config."""
    sp_file = next((f for f in SP_PASS_FILES if (root / f).exists()), None)
    compilation = (root / "vllm/config/compilation.py").read_text()
    if sp_file is None:
        return {"sp_gate": "removed", "sp_gate_file": "vllm/compilation/ (no sequence_parallelism.py)",
                "splitting_ops_empty_needed": None, "sp_threshold_rule": None}
    name, source = method_source(root / sp_file, "is_applicable")
    # vLLM 0.20 on empties splitting_ops itself when SP is on (CompilationConfig.set_splitting_ops_for_v1)
    empties_itself = "to preserve SP and async TP" in compilation
    if name == "is_applicable_for_shape":
        gate, needed = "static_sizes", False  # ignores splitting_ops: SP only at static compile sizes
    elif "min_token_num" in source:
        gate, needed = "sp_min_token_num", not empties_itself
    else:
        gate, needed = "every_size", not empties_itself
    assert gate == "static_sizes" or "splitting_ops" in source, (sp_file, source)
    rule = None
    if "sp_min_token_num" in pass_fields:
        rule = {"min_hidden_size": module_constant(root / sp_file, "SP_MIN_HIDDEN_SIZE"),
                "min_per_gpu_size_mb": module_constant(root / sp_file, "SP_MIN_PER_GPU_SIZE_MB"),
                "file": sp_file}
    return {"sp_gate": gate, "sp_gate_file": f"{sp_file} ({name})", "splitting_ops_empty_needed": needed,
            "sp_threshold_rule": rule}


def model_sp_facts(root: Path) -> dict | None:
    path = root / "vllm/models/common/ops/sequence_parallel.py"
    if not path.exists():
        return None
    tree = ast.parse(path.read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    active = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "is_sequence_parallel_active"),
                  None)
    return {"file": "vllm/models/common/ops/sequence_parallel.py", "functions": functions,
            "is_sequence_parallel_active": None if active is None else [a.arg for a in active.args.args],
            "fused_all_gather_matmul_min_tokens_per_rank": module_constant(path, "_FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK")}


def read(version: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wheel, sha256 = unpack(version, root)
        module = import_compilation(root)
        cc, pc = user_fields(module.CompilationConfig), user_fields(module.PassConfig)
        ranges = next((f for f in ("compile_ranges_endpoints", "compile_ranges_split_points") if f in cc), None)
        flags = ("enable_sp", "fuse_gemm_comms") if "enable_sp" in pc else (
            ("enable_sequence_parallelism", "enable_async_tp") if "enable_sequence_parallelism" in pc else (None, None))
        return {
            "version": version,
            "wheel": wheel,
            "wheel_sha256": sha256,
            "config_file": "vllm/config/compilation.py",
            "compilation_fields": cc,
            "pass_fields": pc,
            "unknown_keys": unknown_keys(module),
            "mode_field": "mode" if "mode" in cc else "level",
            "sp_flag": flags[0],
            "async_tp_flag": flags[1],
            "sp_threshold_field": "sp_min_token_num" if "sp_min_token_num" in pc else None,
            "ranges_field": ranges,
            "cudagraph_modes": [m.name for m in module.CUDAGraphMode],
            **sp_facts(root, pc),
            "model_sp": model_sp_facts(root),
        }


def read_in_subprocess(version: str) -> dict:
    """:func:`read` in a fresh interpreter: releases register torch types that a second import would clash with."""
    out = subprocess.run([sys.executable, __file__, "--one", version], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(json.dumps(read(sys.argv[2])))
        sys.exit(0)
    releases = [read_in_subprocess(v) for v in sys.argv[1:]]
    print(json.dumps({"meta": {"read_by": "benchmarks/vllm_releases/read_releases.py",
                               "how": "each release's wheel from the package index (pip download --no-deps), "
                                      "vllm/config/compilation.py imported on CPU with pydantic, the SP pass and "
                                      "model SP helpers parsed"},
                      "releases": releases}, indent=1))
