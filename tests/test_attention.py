"""sp_lab::attention against SDPA's math path (fp32 and bf16), its kernel choice, and on CUDA the fused kernels.

Tolerances: fp32 against a float64 reference, 2e-5 absolute (sums of at most a few hundred products);
bf16 against the fp32 math path on the same bf16-rounded inputs, 3e-2 absolute (outputs are convex
combinations of values of size ~3 rounded to bf16's 8 bits: a few units of 2**-8 * 3).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sp_lab.models.attention import attention_kernel

FP32_ATOL = 2e-5
BF16_ATOL = 3e-2

SHAPES = [(4, 4, 16), (4, 2, 16), (8, 1, 32), (32, 8, 128)]  # (heads, kv_heads, head_dim)


def _qkv(num_tokens, heads, kv_heads, head_dim, *, dtype=torch.float32, device="cpu", seed=0):
    """q/k/v as the model makes them: column slices of one fused projection output (non-contiguous rows)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(device=device, dtype=dtype)
    return qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)


def _math_reference(q, k, v, heads, kv_heads, dtype):
    """SDPA's math backend in ``dtype`` on 3-D [H, T, D] inputs with K/V repeated (the pre-#11 op)."""
    t, d = q.shape[0], q.shape[1] // heads
    q3, k3, v3 = (x.to(dtype).reshape(t, -1, d).transpose(0, 1) for x in (q, k, v))
    k3, v3 = (x.repeat_interleave(heads // kv_heads, dim=0) for x in (k3, v3))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q3, k3, v3, is_causal=True, scale=d**-0.5)
    return out.transpose(0, 1).reshape(t, heads * d)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_fp32_matches_the_math_path_in_float64(num_tokens, heads, kv_heads, head_dim):
    q, k, v = _qkv(num_tokens, heads, kv_heads, head_dim)
    out = torch.ops.sp_lab.attention(q, k, v, heads, kv_heads, head_dim**-0.5)
    assert out.shape == (num_tokens, heads * head_dim) and out.is_contiguous()
    want = _math_reference(q, k, v, heads, kv_heads, torch.float64)
    torch.testing.assert_close(out.double(), want, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_bf16_matches_the_fp32_math_path(heads, kv_heads, head_dim):
    q, k, v = _qkv(29, heads, kv_heads, head_dim, dtype=torch.bfloat16)
    out = torch.ops.sp_lab.attention(q, k, v, heads, kv_heads, head_dim**-0.5)
    assert out.dtype == torch.bfloat16
    want = _math_reference(q, k, v, heads, kv_heads, torch.float32)
    torch.testing.assert_close(out.float(), want, atol=BF16_ATOL, rtol=0)


def test_later_tokens_do_not_change_earlier_outputs():
    q, k, v = _qkv(12, 4, 2, 16)
    full = torch.ops.sp_lab.attention(q, k, v, 4, 2, 0.25)
    prefix = torch.ops.sp_lab.attention(q[:5], k[:5], v[:5], 4, 2, 0.25)
    torch.testing.assert_close(full[:5], prefix)


def test_kernel_choice_on_cpu():
    q, _, _ = _qkv(3, 8, 2, 16)
    assert attention_kernel(q, 8, 2) == "sdpa+repeat_kv"  # no fused GQA kernel is asked for on the CPU
    assert attention_kernel(q, 8, 8) == "sdpa"



# ------------------------------------------------------------------------------------------- on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash / memory-efficient SDPA)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, BF16_ATOL), (torch.float32, 1e-4)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES)
def test_cuda_matches_the_math_path(dtype, atol, heads, kv_heads, head_dim):
    q, k, v = _qkv(300, heads, kv_heads, head_dim, dtype=dtype, device="cuda")
    out = torch.ops.sp_lab.attention(q, k, v, heads, kv_heads, head_dim**-0.5)
    want = _math_reference(q.double(), k.double(), v.double(), heads, kv_heads, torch.float64)
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=0)


def _cuda_kernels(fn) -> list[str]:
    fn()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("num_tokens", "kernel"), [(1, "flash"), (64, "flash"), (128, "sdpa+gqa"), (2048, "sdpa+gqa")])
def test_cuda_bf16_gqa_runs_a_fused_kernel_on_the_shared_kv_heads(num_tokens, kernel):
    q, k, v = _qkv(num_tokens, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert attention_kernel(q, 32, 8) == kernel
    kernels = _cuda_kernels(lambda: torch.ops.sp_lab.attention(q, k, v, 32, 8, 128**-0.5))
    # flash, or whichever fused kernel SDPA picks (cuDNN's is named "...sdpa..._flash_fprop..." on Hopper).
    assert any("flash" in name.lower() or "fmha" in name.lower() for name in kernels), kernels
    # No K/V repeat (an index/copy kernel) and no score matrix (softmax/gemm kernels of the math path).
    assert not any(w in name.lower() for name in kernels for w in ("index", "softmax", "gemm")), kernels


@pytest.mark.gpu
@gpu
def test_cuda_memory_stays_linear_in_tokens():
    """At 8192 tokens the math path's fp32 scores alone would take 32 * 8192**2 * 4 B = 8 GiB."""
    q, k, v = _qkv(8192, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.ops.sp_lab.attention(q, k, v, 32, 8, 128**-0.5)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 256 * 2**20
