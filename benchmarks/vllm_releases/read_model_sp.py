"""Read where vLLM's model-level sequence parallelism lives in each release's wheel; write ``data/vllm/model_sp.json``.

    python benchmarks/vllm_releases/read_model_sp.py 0.32.0 0.33.0 0.34.0 > data/vllm/model_sp.json

From vLLM 0.32 the SP and AsyncTP compile passes are gone and SP is code inside a few models, built on the helpers
of ``vllm/models/common/ops/sequence_parallel.py``. For each version this downloads the wheel (``pip download
--no-deps``, its sha256 recorded), unzips the model sources only and parses them (nothing of vLLM is imported):

- the helpers file: its public functions, ``is_sequence_parallel_active``'s arguments and the expression it returns,
  and its module-level integer constants with the condition that compares them (``x.shape[0] >= CONST``);
- the model registry (``vllm/model_executor/models/registry.py``): architecture -> module and class;
- every model module or package that imports the helpers: which helpers, each ``is_sequence_parallel_active`` call
  (file, line, class, the source of its arguments), each assignment of the attribute passed as ``min_tokens``
  (file, line, class, the line's text and three lines either side: what a patch needs), each
  ``can_sp_all_gather_matmul`` call, and the on/off switches (assignments to ``*sequence_parallel*`` attributes).

Each release's entry names its wheel. Needs network access to the package index and ~1 GB of free disk per wheel
while it is being read.
"""

from __future__ import annotations

import ast
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from read_releases import unpack  # this folder's reader of wheels

HELPERS = "vllm/models/common/ops/sequence_parallel.py"
HELPERS_MODULE = "vllm.models.common.ops.sequence_parallel"
REGISTRY = "vllm/model_executor/models/registry.py"
PREFIXES = ("vllm/models/", "vllm/model_executor/models/")
GATE = "is_sequence_parallel_active"
FUSED_AG = "can_sp_all_gather_matmul"
CONTEXT = 3


def _enclosing_classes(tree: ast.AST) -> dict[int, str]:
    """Line -> the name of the outermost class around it."""
    out: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                out.setdefault(line, node.name)
    return out


def _context(lines: list[str], line: int) -> dict:
    """The 1-based ``line`` with ``CONTEXT`` lines before and after (what a unified diff's hunk needs)."""
    i = line - 1
    return {"text": lines[i], "before": lines[max(0, i - CONTEXT):i], "after": lines[i + 1:i + 1 + CONTEXT]}


def helpers_facts(path: Path) -> dict:
    source = path.read_text()
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    gate = functions.get(GATE)
    constants = []
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Constant) and type(node.value.value) is int):
            name = node.targets[0].id
            uses = [(fn.name, ast.get_source_segment(source, cmp)) for fn in functions.values()
                    for cmp in ast.walk(fn) if isinstance(cmp, ast.Compare)
                    and any(isinstance(c, ast.Name) and c.id == name for c in ast.walk(cmp))]
            constants.append({"name": name, "value": node.value.value, "line": node.lineno,
                              **_context(source.splitlines(), node.lineno),
                              "compared_in": [{"function": f, "condition": c} for f, c in uses]})
    out = {"file": HELPERS, "functions": [n for n in functions if not n.startswith("_")], "constants": constants}
    if gate is not None:
        ret = next(n for n in ast.walk(gate) if isinstance(n, ast.Return))
        defaults = [None] * (len(gate.args.args) - len(gate.args.defaults)) + [
            ast.literal_eval(d) for d in gate.args.defaults]
        out[GATE] = {"line": gate.lineno, "args": [a.arg for a in gate.args.args], "defaults": defaults,
                     "returns": ast.unparse(ret.value)}
    return out


def registry(path: Path) -> dict[str, str]:
    """Architecture -> ``module:Class`` from the registry's dict literals (the first listing wins)."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not isinstance(value, ast.Dict):
            continue
        for k, v in zip(value.keys, value.values, strict=True):
            if (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts)):
                out.setdefault(k.value, f"{v.elts[0].value}:{v.elts[1].value}")
    return out


def _package_of(rel: str) -> str:
    """The registry's module name for a model file: ``vllm.models.muse_spark`` or ``llama``."""
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:3]) if parts[1] == "models" else parts[-1]


def _imports_helpers(tree: ast.AST) -> list[str]:
    return sorted({a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == HELPERS_MODULE
                   for a in n.names})


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def model_facts(root: Path, reg: dict[str, str]) -> dict[str, dict]:
    files = sorted(p for prefix in PREFIXES for p in (root / prefix).rglob("*.py")
                   if p.relative_to(root).as_posix() != HELPERS)
    parsed = {p.relative_to(root).as_posix(): (p.read_text(), ast.parse(p.read_text())) for p in files}
    users = {rel: _imports_helpers(tree) for rel, (_, tree) in parsed.items()}
    packages: dict[str, dict] = {}
    for rel, helpers in users.items():
        if not helpers or rel.startswith("vllm/models/common/"):
            continue
        pkg = packages.setdefault(_package_of(rel), {"files": {}, "gates": [], "fused_all_gather_matmul": [],
                                                     "min_tokens_assignments": [], "switches": []})
        pkg["files"][rel] = helpers
        source, tree = parsed[rel]
        classes = _enclosing_classes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) == GATE:
                args = [ast.unparse(a) for a in node.args]
                pkg["gates"].append({"file": rel, "line": node.lineno, "class": classes.get(node.lineno),
                                     "args": args})
            elif isinstance(node, ast.Call) and _call_name(node) == FUSED_AG:
                pkg["fused_all_gather_matmul"].append({"file": rel, "line": node.lineno,
                                                       "class": classes.get(node.lineno)})
    for name, pkg in packages.items():
        attrs = {g["args"][2].rsplit(".", 1)[-1] for g in pkg["gates"] if len(g["args"]) > 2}
        prefix = name.replace(".", "/") + "/" if name.startswith("vllm.models.") else None
        scope = [rel for rel in parsed if (prefix and rel.startswith(prefix)) or rel in pkg["files"]]
        for rel in scope:
            source, tree = parsed[rel]
            lines, classes = source.splitlines(), _enclosing_classes(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Attribute)):
                    continue
                attr, rhs = node.targets[0].attr, ast.unparse(node.value)
                if attr in attrs and node.lineno == node.end_lineno:
                    literal = node.value.value if isinstance(node.value, ast.Constant) else None
                    pkg["min_tokens_assignments"].append({
                        "file": rel, "line": node.lineno, "class": classes.get(node.lineno), "attribute": attr,
                        "target": ast.get_source_segment(source, node.targets[0]), "rhs": rhs, "literal": literal,
                        **_context(lines, node.lineno)})
                elif "sequence_parallel" in attr and not isinstance(node.value, ast.Constant):
                    pkg["switches"].append({"file": rel, "line": node.lineno, "class": classes.get(node.lineno),
                                            "target": ast.get_source_segment(source, node.targets[0]), "rhs": rhs})
        pkg["architectures"] = sorted(a for a, target in reg.items()
                                      if target.split(":")[0] == name or target.startswith(name + "."))
    return packages


def read_tree(root: Path) -> dict:
    """The model-level SP facts of an unpacked release under ``root``."""
    helpers = root / HELPERS
    reg = registry(root / REGISTRY)
    return {"helpers": helpers_facts(helpers) if helpers.exists() else None,
            "registry": reg,
            "models": model_facts(root, reg) if helpers.exists() else {}}


def read(version: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        wheel, sha256 = unpack(version, Path(tmp), PREFIXES)
        return {"version": version, "wheel": wheel, "wheel_sha256": sha256, **read_tree(Path(tmp))}


if __name__ == "__main__":
    if sys.argv[1] == "--tree":  # an unpacked release: --tree VERSION WHEEL SHA256 DIR
        version, wheel, sha256, root = sys.argv[2:6]
        releases = [{"version": version, "wheel": wheel, "wheel_sha256": sha256, **read_tree(Path(root))}]
    else:
        releases = [read(v) for v in sys.argv[1:]]
    print(json.dumps({"meta": {"read_by": "benchmarks/vllm_releases/read_model_sp.py",
                               "how": "each release's wheel from the package index (pip download --no-deps), "
                                      "its model sources parsed with ast, nothing imported"},
                      "releases": releases}, indent=1))
