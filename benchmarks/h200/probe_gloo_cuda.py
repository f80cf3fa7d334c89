"""Which collectives work on a gloo group with CUDA tensors (ranks sharing one GPU)? One launch per case.

A case that segfaults kills only its own ranks; the table says which. Run on a GPU machine:
``python benchmarks/h200/probe_gloo_cuda.py`` (prints one JSON line per case).
"""

from __future__ import annotations

import json
import sys
import time

import torch

import sp_lab


def _case(name: str) -> str:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from sp_lab.distributed.collectives import rehearse_on_one_gpu

    device = rehearse_on_one_gpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    x = torch.full((4, 6), float(rank + 1), device=device)
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

    def want_gather(dim):
        return torch.cat([torch.full((4, 6), float(r + 1), device=device) for r in range(world)], dim)

    if name == "funcol.all_reduce":
        got, want = funcol.all_reduce(x, "sum", group), torch.full_like(x, sum(range(1, world + 1)))
    elif name == "funcol.all_gather dim0":
        got, want = gather(x, 0, group), want_gather(0)
    elif name == "funcol.all_gather dim1":
        got, want = gather(x, 1, group), want_gather(1)
    elif name == "funcol.reduce_scatter":
        got = funcol.reduce_scatter_tensor(torch.ones(4 * world, 6, device=device), "sum", 0, group)
        want = torch.full((4, 6), float(world), device=device)
    elif name == "c10d_functional all_gather_into_tensor + wait":
        out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group.group_name)
        got, want = torch.ops._c10d_functional.wait_tensor(out), want_gather(0)
    elif name == "dist.all_gather_into_tensor":
        got = torch.empty(4 * world, 6, device=device)
        dist.all_gather_into_tensor(got, x)
        want = want_gather(0)
    elif name.startswith("compiled"):
        dim = 1 if "dim1" in name else 0
        op = (lambda t: funcol.all_reduce(t, "sum", group)) if "all_reduce" in name else (lambda t: gather(t, dim, group))
        got = torch.compile(lambda t: op(t * 2) + 1, fullgraph=True)(x)
        want = (torch.full_like(x, 2 * sum(range(1, world + 1))) if "all_reduce" in name
                else 2 * want_gather(dim)) + 1
    else:
        raise ValueError(name)
    torch.cuda.synchronize()
    return "ok" if torch.equal(got, want) else f"WRONG max err {float((got - want).abs().max())}"


CASES = [
    "funcol.all_reduce", "funcol.all_gather dim0", "funcol.all_gather dim1", "funcol.reduce_scatter",
    "c10d_functional all_gather_into_tensor + wait", "dist.all_gather_into_tensor",
    "compiled all_reduce", "compiled all_gather dim0", "compiled all_gather dim1",
]

if __name__ == "__main__":
    # By reference, not by value: cloudpickle cannot pickle a __main__ function that mentions torch.ops.
    from probe_gloo_cuda import _case

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for case in CASES:
        start = time.perf_counter()
        try:
            outcome = sp_lab.launch(_case, case, world_size=world, backend="gloo", timeout=180)[0]
        except Exception as e:  # noqa: BLE001 - the probe records whatever happened
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps({"world": world, "case": case, "outcome": outcome,
                          "s": round(time.perf_counter() - start, 1)}), flush=True)
