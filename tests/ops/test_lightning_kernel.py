"""SM90 Lightning-attention prefill kernel (cula/ops/lightning/sm90/chunk_fwd.py).

CPU: every shipped variant traces and compiles for sm_90a, and the PTX holds the instructions the
design depends on. GPU (H200): o and the final state against a float64 token-by-token recurrence.
"""

from __future__ import annotations

import re

import pytest
import torch

from cula.ops.lightning.sm90 import chunk_fwd
from cula.testing import assert_close, make_cu_seqlens, poison_

# (head_dim, has_h0, has_ht, varlen, state_v_first): a spread that touches every trace branch once
CPU_VARIANTS = [
    (128, False, False, False, False),
    (128, True, True, False, False),
    (128, True, True, False, True),
    (128, True, True, True, False),
    (128, False, True, True, True),
    (64, True, True, True, False),
]


@pytest.mark.parametrize("variant", CPU_VARIANTS, ids=lambda v: "D{}-h0{:d}-ht{:d}-varlen{:d}-vfirst{:d}".format(*v))
def test_compiles_for_sm90(variant):
    fn = chunk_fwd.compiled_variant(*variant)
    assert fn is not None
    # a second request is a cache hit, not a recompile
    assert chunk_fwd.compiled_variant(*variant) is fn


# the states-only variants the time-parallel prefill's first pass uses (packed segments, with and without h0)
STATES_VARIANTS = [(128, False, True, True, False), (128, True, True, True, True), (64, False, True, False, False)]


@pytest.mark.parametrize(
    "variant", STATES_VARIANTS, ids=lambda v: "D{}-h0{:d}-varlen{:d}-vfirst{:d}".format(*v[:2], *v[3:])
)
def test_states_only_compiles_for_sm90(variant):
    fn = chunk_fwd.compiled_variant(*variant, states_only=True)
    assert fn is not None and chunk_fwd.compiled_variant(*variant, states_only=True) is fn
    assert chunk_fwd.compiled_variant(*variant) is not fn
    with pytest.raises(ValueError, match="has_ht"):
        chunk_fwd.LightningFwdSm90(128, False, False, False, False, states_only=True)


def test_states_only_ptx_reads_k_and_v_and_writes_no_output():
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_stream

    from cula.cache import compile_options

    B, T, H, HV = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    args = [None, chunk_fwd._fake(bf16, (B, T, H, 128)), chunk_fwd._fake(bf16, (B, T, HV, 128)), None,
            cute.runtime.make_fake_compact_tensor(f32, (HV,), assumed_align=4), None,
            chunk_fwd._fake(f32, (B, HV, 128, 128)), None, f32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True)]
    kernel = chunk_fwd.LightningFwdSm90(128, False, True, False, False, states_only=True)
    ptx = cute.compile(kernel, *args, options=compile_options((9, 0), "--keep-ptx")).__ptx__
    assert "wgmma.mma_async" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx
    # k (two 64-column boxes at D = 128) and v^T (one): the full kernel's five loads less q's two
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global", ptx)) == 3
    assert "cp.async.bulk.tensor.4d.global.shared::cta" not in ptx and "stmatrix" not in ptx  # no output
    assert ".local" not in ptx


def test_ptx_uses_tma_wgmma_and_register_handoff():
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_stream

    from cula.cache import compile_options

    B, T, H, HV = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    args = [chunk_fwd._fake(bf16, (B, T, H, 128)), chunk_fwd._fake(bf16, (B, T, H, 128)),
            chunk_fwd._fake(bf16, (B, T, HV, 128)), chunk_fwd._fake(bf16, (B, T, HV, 128)),
            cute.runtime.make_fake_compact_tensor(f32, (HV,), assumed_align=4), None,
            chunk_fwd._fake(f32, (B, HV, 128, 128)), None, f32(1.0),
            make_fake_stream(use_tvm_ffi_env_stream=True)]
    kernel = chunk_fwd.LightningFwdSm90(128, False, True, False, False)
    fn = cute.compile(kernel, *args, options=compile_options((9, 0), "--keep-ptx"))
    ptx = fn.__ptx__
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx      # TMA store of o
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx              # v^T into registers
    assert "stmatrix.sync.aligned" in ptx
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232", ptx)
    assert ".local" not in ptx  # nothing demoted to local memory before ptxas


# ------------------------------------------------------------------------------------------------
# GPU correctness


def reference(q, k, v, decay, scale, h0=None, cu_seqlens=None):
    """float64 token-by-token recurrence. Returns o [B, T, HV, V] and the final state [N, HV, K, V]."""
    q, k, v = q.double(), k.double(), v.double()
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    lam = torch.exp(-decay.double())[:, None, None]
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    states = []
    for n, (b, start, end) in enumerate(spans):
        S = torch.zeros(HV, K, V, dtype=torch.float64, device=q.device) if h0 is None else h0[n].double()
        for t in range(start, end):
            S = lam * S + k[b, t, :, :, None] * v[b, t, :, None, :]
            o[b, t] = scale * torch.einsum("hk,hkv->hv", q[b, t], S)
        states.append(S)
    return o, torch.stack(states)


def run_case(B, T, H, HV, D, decay_kind, use_h0, state_v_first, lengths=None, seed=0):
    torch.manual_seed(seed)
    dev = "cuda"
    if lengths is not None:
        B, T = 1, sum(lengths)
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, D, device=dev, dtype=torch.bfloat16)
    decay = {
        "zero": torch.zeros(HV),
        "strong": torch.full((HV,), 5.0),
        "mixed": torch.linspace(0.0, 1.0, HV) ** 2 * 2.0,
    }[decay_kind].to(dev, torch.float32)
    cu = None if lengths is None else make_cu_seqlens(lengths, device=dev)
    N = B if lengths is None else len(lengths)
    scale = D ** -0.5
    h0 = torch.randn(N, HV, D, D, device=dev, dtype=torch.float32) if use_h0 else None
    o = poison_(torch.empty(B, T, HV, D, device=dev, dtype=torch.bfloat16))
    ht = poison_(torch.empty(N, HV, D, D, device=dev, dtype=torch.float32))
    h0_arg = None if h0 is None else (h0.transpose(-1, -2).contiguous() if state_v_first else h0)
    chunk_fwd.lightning_fwd_sm90(q, k, v, decay, o, h0_arg, ht, cu, scale=scale, state_v_first=state_v_first)
    torch.cuda.synchronize()
    ref_o, ref_ht = reference(q, k, v, decay, scale, h0, cu)
    if state_v_first:
        ht = ht.transpose(-1, -2)
    assert_close("o", ref_o, o, 5e-3)
    assert_close("ht", ref_ht, ht, 5e-3)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 63, 64, 100, 1000, 4096])
@pytest.mark.parametrize("decay_kind", ["zero", "strong", "mixed"])
def test_fixed_length(T, decay_kind):
    run_case(B=2, T=T, H=4, HV=4, D=128, decay_kind=decay_kind, use_h0=False, state_v_first=False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("H,HV", [(4, 4), (2, 4)])
@pytest.mark.parametrize("T", [100, 1000])
def test_initial_state_layouts_gva(T, H, HV, state_v_first):
    run_case(B=2, T=T, H=H, HV=HV, D=128, decay_kind="mixed", use_h0=True, state_v_first=state_v_first)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("decay_kind", ["zero", "strong", "mixed"])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("use_h0", [False, True])
def test_varlen(use_h0, state_v_first, decay_kind):
    run_case(B=1, T=0, H=2, HV=4, D=128, decay_kind=decay_kind, use_h0=use_h0, state_v_first=state_v_first,
             lengths=[0, 1, 63, 300, 64])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lengths", [None, [5, 130, 64]])
def test_head_dim_64(lengths):
    run_case(B=2, T=200, H=4, HV=4, D=64, decay_kind="mixed", use_h0=True, state_v_first=False, lengths=lengths)


@pytest.mark.gpu
@gpu
def test_without_final_state():
    """The ht=None variant must still write all of o."""
    torch.manual_seed(1)
    q = torch.randn(1, 130, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    decay = torch.tensor([0.0, 0.3], device="cuda")
    o = poison_(torch.empty_like(v))
    chunk_fwd.lightning_fwd_sm90(q, k, v, decay, o, None, None, None, scale=0.1, state_v_first=False)
    ref_o, _ = reference(q, k, v, decay, 0.1)
    assert_close("o", ref_o, o, 5e-3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D,state_v_first,use_h0", [(128, False, False), (128, True, True), (64, False, True)])
def test_states_only_final_states(D, state_v_first, use_h0):
    """The states-only variant's final states against the float64 recurrence: packed with empty and length-1
    sequences, GVA, a zero, a slow and a strong decay; nothing but the final states written."""
    torch.manual_seed(1)
    dev, lengths, H, HV = "cuda", [300, 0, 1, 64, 129], 2, 4
    T, N = sum(lengths), len(lengths)
    k = torch.randn(1, T, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, D, device=dev, dtype=torch.bfloat16)
    decay = torch.tensor([0.0, 0.01, 1.0, 5.0], device=dev)
    cu = make_cu_seqlens(lengths, device=dev)
    h0 = torch.randn(N, HV, D, D, device=dev) if use_h0 else None
    ht = poison_(torch.empty(N, HV, D, D, device=dev))
    h0_arg = None if h0 is None else (h0.transpose(-1, -2).contiguous() if state_v_first else h0)
    chunk_fwd.lightning_states_sm90(k, v, decay, h0_arg, ht, cu, state_v_first=state_v_first)
    torch.cuda.synchronize()
    _, ref_ht = reference(torch.zeros_like(k), k, v, decay, 1.0, h0, cu)
    assert_close("ht", ref_ht, ht.transpose(-1, -2) if state_v_first else ht, 5e-3)
