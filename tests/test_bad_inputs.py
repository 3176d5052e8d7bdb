"""Bad-input fuzz test of every public function.

From a valid base call of each public function a seeded generator derives many malformed variants: wrong dtypes
(float64, integer, bool, another float type), ranks, shapes, strides (non-contiguous views, a strided last dim),
misaligned tensors (storage offset of one element), wrong devices (a ``meta`` tensor on the CPU, a CPU tensor on the
GPU), objects that are not tensors, missing required tensors, bad ``cu_seqlens``, out-of-range and wrong-dtype state
indices, non-finite gates, unknown keywords and bad scalars. Each variant must

- raise ``TypeError`` / ``ValueError`` naming the offending argument (or ``BackendUnavailableError``, the documented
  refusal) before anything runs: no backend ran, no kernel launched, no input written; or
- be accepted and give the base call's result (a legitimately supported variant: a copy is made where a kernel needs
  one, or a backend that supports it runs the call and the registry logs why the others declined). A tensor the call
  only reads, strided in its last dimension, must be accepted: FLA's wrappers copy it, and so does cula.

Non-finite gate values are not checked (that would cost a device sync a call, as FLA does not either): such a call
must not fail or write outside its outputs; its numbers are whatever the math gives.

Three runs of the same cases:

- ``test_cpu``: CPU tensors, the dispatch as on a CPU-only machine (the ``reference`` backends).
- ``test_cuda_path``: CPU tensors that select the ``cula-sm90`` backends (``pretend_sm90``), with ``cute.compile``
  replaced by a recorder of launches that checks every argument against the kernel's own compile-time signature
  (dtypes, ranks, static sizes and strides, symbolic sizes shared between arguments, alignment, row-major tensors
  where the kernel takes compact ones, None where the variant takes none, plain finite scalars), which is what
  TVM-FFI checks at a real launch; FLA's backends record the call instead of running.
- ``test_gpu`` (``-m gpu``): CUDA tensors for real, a few cases per function, with guard bands around every in-place
  output and the pool rows a call does not index checked bit for bit.

The plan caches (``chunk_kda``'s fast path, the decode plans, the step closures) see the base call before the cases,
so every bad case follows a good call of a similar signature and must still be refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re
import zlib
from typing import Any, Callable

import pytest
import torch

from cula.backends import BackendUnavailableError, clear_plan_caches

OTHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.bool)


class Routed(Exception):
    """Raised by the recording FLA backends of ``test_cuda_path``: the call reached FLA (which cannot run on CPU
    tensors); its validation and backend choice are what is tested."""


# --------------------------------------------------------------------------------------------------------- specs
@dataclasses.dataclass
class Spec:
    """One public function: how to call it, its valid base call, and what its variants may do."""

    name: str
    call: Callable[[dict], Any]
    base: Callable[[str], dict]  # device -> a valid call (fresh tensors, the same values every time)
    inplace: tuple[str, ...] = ()  # tensors the call writes (state pools, `out`); all others must stay untouched
    pool: str | None = None  # the state pool, whose rows not indexed by the call must stay untouched
    index: str | None = None  # the pool's row indices
    coupled: tuple[str, ...] = ("q", "k", "v")  # tensors whose sizes define the others' (any name may be reported)
    required: tuple[str, ...] = ("q", "k", "v")  # tensors that may not be None
    gates: tuple[str, ...] = ()  # tensors whose values are not checked (non-finite cases)
    fixed_dim0: tuple[str, ...] = ()  # tensors whose first dim may take any size (pool rows)
    flexible_rank: tuple[str, ...] = ()  # tensors whose rank may change as long as the element count does not
    # what else an error about a tensor of one rank less may name (kda_decode's g [N, T, HV], the per-head gate form,
    # takes a dt_bias [HV])
    lower_rank_names: tuple[str, ...] = ()
    # (label, updates, names, must_raise): scalar, keyword and value cases; must_raise None: either, not compared
    extra: tuple = ()
    modes: tuple[str, ...] = ("cpu", "cuda_path", "gpu")
    # test_gpu: FLA runs the base call (only the refused variants are run: accepted ones would compile Triton
    # kernels of their own); whether the accepted layout variants (copies, other backends) are run
    fla_on_gpu: bool = False
    gpu_layouts: bool = True
    gpu_skip: tuple[str, ...] = ()  # label prefixes of accepted cases test_gpu leaves out (they would run on FLA)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    # made on the CPU and moved, so every device sees the same values
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def _guarded(t: torch.Tensor, pad: int = 16) -> torch.Tensor:
    """``t``'s values in a view of a larger buffer with ``pad`` sentinel elements on either side, which no call may
    write (``_Snapshot``); ``pad`` keeps the view 16-byte aligned."""
    buf = torch.full((t.numel() + 2 * pad,), 7.0 if t.is_floating_point() else 7, dtype=t.dtype, device=t.device)
    view = buf[pad : pad + t.numel()].view(t.shape)
    view.copy_(t)
    view._guard = (buf, pad)  # read by _Snapshot
    return view


# KDA: K = V = 128 and bf16 so that the cula-sm90 backends take the base calls; tiny B and T keep the CPU reference
# cheap. safe_gate with the lower-bound gate takes cula's intra kernel (FLA's Triton stages cannot run on the CPU).
KB, KT, KH, KHV = 2, 3, 1, 2
# Head sizes: the kernels' (K = V = 128 for KDA's chunk kernels, 64 for the decode and Lightning ones) where kernels
# run or are checked; test_cpu, where only the reference computes, takes small ones (HEAD_DIMS_CPU).
HEAD_DIMS = {"kda": 128, "decode": 64, "gla": 64}
HEAD_DIMS_CPU = {"kda": 32, "decode": 16, "gla": 16}
KDA_FLAGS = dict(
    output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
    safe_gate=True, lower_bound=-5.0, state_v_first=True,
)  # fmt: skip


def _kda_tokens(device, B=KB, T=KT, D=None, H=KH, HV=KHV, dtype=torch.bfloat16, seed=0):
    gen = _gen(seed)
    D = D or HEAD_DIMS["kda"]
    q, k, v = (_randn(gen, B, T, h, D, dtype=dtype, device=device) for h in (H, H, HV))
    return dict(q=q, k=k, v=v, g=_randn(gen, B, T, HV, D, device=device), beta=_randn(gen, B, T, HV, device=device))


def _kda_gate_params(device, HV=KHV, D=None, seed=1):
    gen = _gen(seed)
    D = D or HEAD_DIMS["kda"]
    return dict(
        A_log=_randn(gen, HV, device=device, scale=0.5), dt_bias=_randn(gen, HV * D, device=device, scale=0.5)
    )


def _chunk_kda_base(device):
    x, D = _kda_tokens(device), HEAD_DIMS["kda"]
    x["initial_state"] = _randn(_gen(2), KB, KHV, D, D, device=device, scale=0.1)
    return dict(x, **_kda_gate_params(device), **KDA_FLAGS)


def _chunk_kda_logspace_base(device):
    x = _kda_tokens(device)
    x["g"] = torch.nn.functional.logsigmoid(x["g"]) / 8
    x["beta"] = x["beta"].sigmoid()
    return dict(x, scale=0.1, output_final_state=True, safe_gate=True)


KDA_LENS = (3, 0, 5)  # packed: a zero-length sequence among them
KDA_CU = [0, 3, 3, 8]


def _chunk_kda_varlen_base(device):
    x, D = _kda_tokens(device, B=1, T=sum(KDA_LENS)), HEAD_DIMS["kda"]
    cu = torch.tensor(KDA_CU, dtype=torch.int32)
    x["initial_state"] = _randn(_gen(2), len(KDA_LENS), KHV, D, D, device=device, scale=0.1)
    return dict(x, **_kda_gate_params(device), **KDA_FLAGS, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


def _fused_recurrent_kda_base(device):
    x, D = _kda_tokens(device), HEAD_DIMS["kda"]
    x["initial_state"] = _randn(_gen(2), KB, KHV, D, D, device=device, scale=0.1)
    flags = {n: KDA_FLAGS[n] for n in ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                                       "use_beta_sigmoid_in_kernel", "lower_bound", "state_v_first")}  # fmt: skip
    return dict(x, **_kda_gate_params(device), **flags)


def _fused_recurrent_kda_varlen_base(device):
    x, D = _kda_tokens(device, B=1, T=sum(KDA_LENS)), HEAD_DIMS["kda"]
    x["initial_state"] = _randn(_gen(2), len(KDA_LENS), KHV, D, D, device=device, scale=0.1)
    return dict(
        x, **_kda_gate_params(device), output_final_state=True, inplace_final_state=False, use_gate_in_kernel=True,
        lower_bound=-5.0, cu_seqlens=torch.tensor(KDA_CU, dtype=torch.int32, device=device),
    )  # fmt: skip


# decode: N sequences, a pool of P rows of which the call indexes rows 4 and 0 (slot 1 is padded)
DN, DH, DHV, DP = 3, 1, 2, 6
DECODE_ROWS = [4, -1, 0]


def _pool(device, P=DP, HV=DHV, seed=3):
    D = HEAD_DIMS["decode"]
    return _guarded(_randn(_gen(seed), P, HV, D, D, device=device, scale=0.1))


def _decode_tokens(device, T=1, seed=0):
    return _kda_tokens(device, B=DN, T=T, D=HEAD_DIMS["decode"], H=DH, HV=DHV, seed=seed)


def _decode_out(device, T=1):
    return _guarded(torch.zeros(DN, T, DHV, HEAD_DIMS["decode"], dtype=torch.bfloat16, device=device))


def _decode_rows(device, rows=DECODE_ROWS):
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _kda_decode_base(device):
    return dict(
        _decode_tokens(device), state_pool=_pool(device), state_indices=_decode_rows(device),
        **_kda_gate_params(device, HV=DHV, D=HEAD_DIMS["decode"]), lower_bound=-5.0, scale=0.25,
        out=_decode_out(device),
    )  # fmt: skip


def _kda_decode_mtp_base(device):
    D = HEAD_DIMS["decode"]
    return dict(
        _decode_tokens(device, T=2), state_pool=_pool(device), state_indices=_decode_rows(device),
        **_kda_gate_params(device, HV=DHV, D=D), state_v_first=False,
        step_states=_guarded(torch.zeros(DN, 2, DHV, D, D, device=device)),
    )  # fmt: skip


def _gdn_decode_base(device):
    """GDN's pooled decode: KDA's decode call with a scalar gate and GDN's fused-gate parameters ([HV] each)."""
    gen = _gen(5)
    return dict(
        _decode_tokens(device), g=_randn(gen, DN, 1, DHV, device=device), state_pool=_pool(device),
        state_indices=_decode_rows(device), A_log=_randn(gen, DHV, device=device, scale=0.5),
        dt_bias=_randn(gen, DHV, device=device, scale=0.5), scale=0.25, out=_decode_out(device),
    )  # fmt: skip


def _gdn_decode_step_call(call):
    from cula.gated_delta_rule import gdn_decode_step

    tokens = {n: call[n] for n in ("q", "k", "v", "g", "beta", "out", "step_states") if n in call}
    bound = {n: v for n, v in call.items() if n not in tokens}
    step = gdn_decode_step(bound.pop("state_pool"), bound.pop("state_indices"), **bound)
    return step(**tokens)


def _kda_pool_fwd_base(device):
    """FLA's serving form on a state pool (the cula-sm90 backend runs it on the decode kernel)."""
    return dict(
        _decode_tokens(device), initial_state=_pool(device), ssm_state_indices=_decode_rows(device, [4, 2, 0]),
        **_kda_gate_params(device, HV=DHV, D=HEAD_DIMS["decode"]), use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, state_v_first=True,
        inplace_final_state=True, out=_decode_out(device),
    )  # fmt: skip


def _kda_decode_step_call(call):
    from cula.kda import kda_decode_step

    tokens = {n: call[n] for n in ("q", "k", "v", "g", "beta", "out", "step_states") if n in call}
    bound = {n: call[n] for n in call if n not in tokens}
    step = kda_decode_step(bound.pop("state_pool"), bound.pop("state_indices"), **bound)
    return step(**tokens)


def _commit_base(device):
    gen = _gen(4)
    return dict(
        step_states=_randn(gen, DN, 2, DHV, 16, 16, device=device),
        state_pool=_guarded(_randn(gen, DP, DHV, 16, 16, device=device)), state_indices=_decode_rows(device),
        num_accepted_tokens=torch.tensor([2, 1, 1], dtype=torch.int32, device=device),
    )  # fmt: skip


# Gated DeltaNet (FLA's kernels), Simple GLA and Lightning (the Lightning kernel for g_gamma, bf16, K = V = 64)
GB, GT, GH, GHV = 2, 3, 1, 2


def _gla_tokens(device, B=GB, T=GT, seed=0):
    x = _kda_tokens(device, B=B, T=T, D=HEAD_DIMS["gla"], H=GH, HV=GHV, seed=seed)
    return {n: x[n] for n in ("q", "k", "v")}


def _gla_state(gen, device, N=GB):
    D = HEAD_DIMS["gla"]
    return _randn(gen, N, GHV, D, D, device=device, scale=0.1)


def _gdn_base(device):
    gen = _gen(5)
    return dict(
        _gla_tokens(device), g=torch.nn.functional.logsigmoid(_randn(gen, GB, GT, GHV, device=device)),
        beta=_randn(gen, GB, GT, GHV, device=device).sigmoid(), initial_state=_gla_state(gen, device),
        output_final_state=True,
    )  # fmt: skip


def _gdn_fused_gate_base(device):
    gen = _gen(6)
    return dict(
        _gdn_base(device), g=_randn(gen, GB, GT, GHV, device=device), use_gate_in_kernel=True,
        A_log=_randn(gen, GHV, device=device, scale=0.5), dt_bias=_randn(gen, GHV, device=device, scale=0.5),
    )  # fmt: skip


def _gdn_recurrent_base(device):
    gen, D = _gen(7), HEAD_DIMS["gla"]
    x = _gdn_base(device)
    x["gk"] = torch.nn.functional.logsigmoid(_randn(gen, GB, GT, GHV, D, device=device)) / 4
    x["gv"] = torch.nn.functional.logsigmoid(_randn(gen, GB, GT, GHV, D, device=device)) / 4
    return x


def _gla_base(device, g_gamma=True):
    gen = _gen(8)
    x = dict(_gla_tokens(device), initial_state=_gla_state(gen, device), output_final_state=True)
    if g_gamma:
        x["g_gamma"] = -torch.rand(GHV, generator=gen).to(device)
    else:
        x["g"] = torch.nn.functional.logsigmoid(_randn(gen, GB, GT, GHV, device=device))
    return x


def _gla_varlen_base(device):
    gen = _gen(9)
    cu = torch.tensor(KDA_CU, dtype=torch.int32)
    return dict(
        _gla_tokens(device, B=1, T=sum(KDA_LENS)), g_gamma=-torch.rand(GHV, generator=gen).to(device),
        initial_state=_gla_state(gen, device, N=len(KDA_LENS)), output_final_state=True, cu_seqlens=cu.to(device),
        cu_seqlens_cpu=cu,
    )  # fmt: skip


def _lightning_base(device):
    x = _gla_base(device)
    x["decay"] = -x.pop("g_gamma")
    return x


def _lightning_layer_base(device):
    x = _gla_base(device)
    x.pop("g_gamma")
    x["v"] = x["v"][:, :, :GH].contiguous()  # FLA's Lightning wrappers have H value heads
    x["initial_state"] = x["initial_state"][:, :GH].contiguous()
    return dict(x, layer_idx=1, num_layers=4)


def _lightning_decode_base(device):
    x = _decode_tokens(device)
    return dict(
        q=x["q"], k=x["k"], v=x["v"], decay=torch.rand(DHV, generator=_gen(10)).to(device),
        state_pool=_pool(device), state_indices=_decode_rows(device), out=_decode_out(device),
    )  # fmt: skip


def _lightning_decode_step_call(call):
    from cula.lightning import lightning_decode_step

    tokens = {n: call[n] for n in ("q", "k", "v", "out") if n in call}
    bound = {n: call[n] for n in call if n not in tokens}
    step = lightning_decode_step(bound.pop("decay"), bound.pop("state_pool"), bound.pop("state_indices"), **bound)
    return step(**tokens)


def _fn(module: str, name: str) -> Callable[[dict], Any]:
    def call(kwargs):
        import importlib

        return getattr(importlib.import_module(module), name)(**kwargs)

    call.__name__ = name
    return call


# cases shared by the functions that take them: (label, updates, names, must_raise)
SCALE_CASES = (
    ("scale=nan", {"scale": float("nan")}, ("scale",), True),
    ("scale=inf", {"scale": float("inf")}, ("scale",), True),
    ("scale=str", {"scale": "0.5"}, ("scale",), True),
    ("scale=tensor", {"scale": torch.tensor(0.5)}, ("scale",), True),
)
UNKNOWN_KW = (("unknown keyword", {"not_an_argument": 1}, ("not_an_argument",), True),)
LOWER_BOUND_CASES = (
    ("lower_bound=nan", {"lower_bound": float("nan")}, ("lower_bound",), True),
    ("lower_bound=str", {"lower_bound": "-5"}, ("lower_bound",), True),
    ("lower_bound=inf", {"lower_bound": -float("inf")}, ("lower_bound",), True),
)
KDA_FLAG_CASES = (
    ("lower_bound out of the safe range", {"lower_bound": -6.0}, ("lower_bound",), True),
    ("lower_bound=0", {"lower_bound": 0.0}, ("lower_bound",), True),
    ("safe_gate without lower_bound", {"lower_bound": None}, ("lower_bound",), True),
    ("allow_neg_eigval without the beta sigmoid", {"allow_neg_eigval": True, "use_beta_sigmoid_in_kernel": False},
     ("allow_neg_eigval",), True),
    ("chunk_size=48", {"chunk_size": 48}, ("chunk_size",), True),
    ("both state layout names", {"transpose_state_layout": True}, ("transpose_state_layout",), True),
)  # fmt: skip
DECODE_CASES = (
    ("index = P", {"state_indices": torch.tensor([4, -1, DP], dtype=torch.int32)}, ("state_indices",), True),
    ("index > P", {"state_indices": torch.tensor([DP + 9, -1, 0], dtype=torch.int32)}, ("state_indices",), True),
    ("index int64", {"state_indices": torch.tensor(DECODE_ROWS)}, ("state_indices",), True),
    # any negative index is a padded slot: the same result as the base call's -1
    ("index -7", {"state_indices": torch.tensor([4, -7, 0], dtype=torch.int32)}, (), False),
)
CU_CASES = (
    ("cu_seqlens decreasing", [0, 5, 3, 8], True),
    ("cu_seqlens not from 0", [1, 3, 3, 8], True),
    ("cu_seqlens short of T", [0, 3, 3, 7], True),
    ("cu_seqlens past T", [0, 3, 3, 9], True),
    ("cu_seqlens one entry", [8], True),
)


def _cu_cases(spec_has_cpu: bool) -> tuple:
    cases = []
    for label, values, must in CU_CASES:
        cu = torch.tensor(values, dtype=torch.int32)
        upd = {"cu_seqlens": cu}
        if spec_has_cpu:
            upd["cu_seqlens_cpu"] = cu.clone()
        cases.append((label, upd, ("cu_seqlens",), must))
    cu = torch.tensor(KDA_CU, dtype=torch.int32)
    cases += [
        ("cu_seqlens float", {"cu_seqlens": cu.float()}, ("cu_seqlens",), True),
        ("cu_seqlens 2-D", {"cu_seqlens": cu[None]}, ("cu_seqlens",), True),
        ("cu_seqlens int16", {"cu_seqlens": cu.short()}, ("cu_seqlens",), True),
        ("cu_seqlens int64", {"cu_seqlens": cu.long()}, (), False),
    ]
    if spec_has_cpu:
        cases += [
            ("cu_seqlens_cpu of another length", {"cu_seqlens_cpu": cu[:3].clone()}, ("cu_seqlens_cpu",), True),
            ("cu_seqlens_cpu float", {"cu_seqlens_cpu": cu.float()}, ("cu_seqlens_cpu",), True),
            ("cu_seqlens_cpu on meta", {"cu_seqlens_cpu": cu.to("meta")}, ("cu_seqlens_cpu",), True),
            ("cu_seqlens_cpu without cu_seqlens", {"cu_seqlens": None}, ("cu_seqlens_cpu", "cu_seqlens"), True),
        ]
    return tuple(cases)


NO_VARLEN_CPU = (("cu_seqlens_cpu without cu_seqlens", {"cu_seqlens_cpu": torch.tensor([0, KT])},
                  ("cu_seqlens_cpu", "cu_seqlens"), True),)  # fmt: skip

SPECS = [
    Spec("chunk_kda", _fn("cula.kda", "chunk_kda"), _chunk_kda_base, required=("q", "k", "v", "g", "beta"),
         gates=("g", "beta", "A_log", "dt_bias"), flexible_rank=("A_log", "dt_bias"),
         extra=SCALE_CASES + UNKNOWN_KW + LOWER_BOUND_CASES + KDA_FLAG_CASES + NO_VARLEN_CPU + (
             ("use_gate_in_kernel without A_log or lower_bound", {"lower_bound": None, "A_log": None,
              "safe_gate": False}, ("A_log",), True),
             ("return_intermediate_states outside inference", {"return_intermediate_states": True},
              ("return_intermediate_states",), True),
             ("no tokens", {"_tokens": 0}, (), None),
             ("no heads", {"_no_heads": True}, ("q", "v"), True),
         )),  # fmt: skip
    Spec("chunk_kda[log-space gate]", _fn("cula.kda", "chunk_kda"), _chunk_kda_logspace_base,
         required=("q", "k", "v", "g", "beta"), gates=("g", "beta"), extra=SCALE_CASES, gpu_layouts=False),
    Spec("chunk_kda[varlen]", _fn("cula.kda", "chunk_kda"), _chunk_kda_varlen_base,
         required=("q", "k", "v", "g", "beta"), gates=("g", "beta"), flexible_rank=("A_log", "dt_bias"),
         extra=_cu_cases(True) + (
             ("batch of 2 with cu_seqlens", {"_batch2": True}, ("cu_seqlens", "batch"), True),
         ),
         gpu_layouts=False),
    Spec("fused_recurrent_kda", _fn("cula.kda", "fused_recurrent_kda"), _fused_recurrent_kda_base,
         required=("q", "k", "v", "g", "beta"), gates=("g", "beta", "A_log", "dt_bias"),
         flexible_rank=("A_log", "dt_bias"), extra=SCALE_CASES + UNKNOWN_KW + LOWER_BOUND_CASES + (
             ("per-value beta", {"_beta_per_value": True}, (), False),
         ), fla_on_gpu=True),  # fmt: skip
    Spec("fused_recurrent_kda_fwd[varlen]", _fn("cula.kda", "fused_recurrent_kda_fwd"),
         _fused_recurrent_kda_varlen_base, required=("q", "k", "v", "g", "beta"), gates=("g",),
         flexible_rank=("A_log", "dt_bias"), extra=_cu_cases(False) + (
             ("inplace_final_state without a state", {"initial_state": None, "inplace_final_state": True},
              ("initial_state",), True),
         ), fla_on_gpu=True),  # fmt: skip
    Spec("fused_recurrent_kda_fwd[pool]", _fn("cula.kda", "fused_recurrent_kda_fwd"), _kda_pool_fwd_base,
         inplace=("initial_state", "out"), pool="initial_state", index="ssm_state_indices",
         fixed_dim0=("initial_state",),
         required=("q", "k", "v", "g", "beta"), gates=("g", "beta"), flexible_rank=("A_log", "dt_bias"),
         extra=SCALE_CASES + (
             ("index int64", {"ssm_state_indices": torch.tensor([4, 2, 0])}, (), False),
             ("indices without a pool", {"initial_state": None, "inplace_final_state": False}, ("initial_state",
              "ssm_state_indices"), True),
             # FLA's kernel trusts these shapes: each would read or write rows past a tensor or of other sequences
             ("a pool of other rows", {"initial_state": torch.zeros(DP, 1, HEAD_DIMS["decode"], HEAD_DIMS["decode"])},
              ("initial_state",), True),
             ("[N] indices with two tokens", {"_tokens": 2, "out": None}, ("ssm_state_indices",), True),
             ("num_accepted_tokens with [N] indices", {"num_accepted_tokens": torch.ones(DN, dtype=torch.int32)},
              ("num_accepted_tokens",), True),
             ("new states nowhere", {"inplace_final_state": False}, ("output_final_state",), True),
         ), gpu_skip=("index int64", "initial_state:")),  # fmt: skip
    Spec("kda_decode", _fn("cula.kda", "kda_decode"), _kda_decode_base, inplace=("state_pool", "out"),
         lower_rank_names=("dt_bias",),
         pool="state_pool", index="state_indices", fixed_dim0=("state_pool",), required=("q", "k", "v", "g", "beta",
         "state_pool", "state_indices"), gates=("g", "beta", "A_log", "dt_bias"),
         extra=SCALE_CASES + UNKNOWN_KW + LOWER_BOUND_CASES + DECODE_CASES + (
             ("T=9 tokens", {"_tokens": 9}, ("T", "tokens"), True),
             ("T=0 tokens", {"_tokens": 0}, ("T", "tokens"), True),
             ("softplus gate without A_log", {"A_log": None, "lower_bound": None}, ("A_log",), True),
         )),  # fmt: skip
    Spec("kda_decode[mtp, step_states]", _fn("cula.kda", "kda_decode"), _kda_decode_mtp_base,
         inplace=("state_pool", "step_states"), lower_rank_names=("dt_bias",), pool="state_pool", index="state_indices",
         fixed_dim0=("state_pool",),
         required=("q", "k", "v", "g", "beta", "state_pool", "state_indices"), gates=("g",), extra=DECODE_CASES),
    Spec("kda_decode_step", _kda_decode_step_call, _kda_decode_base, inplace=("state_pool", "out"),
         lower_rank_names=("dt_bias",),
         pool="state_pool", index="state_indices", fixed_dim0=("state_pool",), required=("q", "k", "v", "g", "beta",
         "state_pool", "state_indices"), gates=("g", "beta", "A_log"), extra=SCALE_CASES + UNKNOWN_KW +
         LOWER_BOUND_CASES + DECODE_CASES),  # fmt: skip
    Spec("kda_commit_accepted", _fn("cula.kda", "kda_commit_accepted"), _commit_base, inplace=("state_pool",),
         pool="state_pool", index="state_indices", fixed_dim0=("state_pool",), coupled=("step_states",),
         required=("step_states", "state_pool", "state_indices", "num_accepted_tokens"),
         extra=DECODE_CASES[:3] + (
             ("accepted > T", {"num_accepted_tokens": torch.tensor([3, 1, 1], dtype=torch.int32)},
              ("num_accepted_tokens",), True),
             ("accepted < 0", {"num_accepted_tokens": torch.tensor([2, 1, -1], dtype=torch.int32)},
              ("num_accepted_tokens",), True),
             ("accepted int64", {"num_accepted_tokens": torch.tensor([2, 1, 1])}, (), False),
         )),  # fmt: skip
    Spec("gdn_decode", _fn("cula.gated_delta_rule", "gdn_decode"), _gdn_decode_base, inplace=("state_pool", "out"),
         pool="state_pool", index="state_indices", fixed_dim0=("state_pool",), required=("q", "k", "v", "g", "beta",
         "state_pool", "state_indices"), gates=("g", "beta", "A_log", "dt_bias"),
         extra=SCALE_CASES + UNKNOWN_KW + DECODE_CASES + (
             ("T=9 tokens", {"_tokens": 9}, ("T", "tokens"), True),
             ("fused gate without A_log", {"A_log": None}, ("A_log",), True),
         )),  # fmt: skip
    Spec("gdn_decode_step", _gdn_decode_step_call, _gdn_decode_base, inplace=("state_pool", "out"),
         pool="state_pool", index="state_indices", fixed_dim0=("state_pool",), required=("q", "k", "v", "g", "beta",
         "state_pool", "state_indices"), gates=("g", "beta", "A_log", "dt_bias"),
         extra=SCALE_CASES + UNKNOWN_KW + DECODE_CASES),
    Spec("gdn_commit_accepted", _fn("cula.gated_delta_rule", "gdn_commit_accepted"), _commit_base,
         inplace=("state_pool",), pool="state_pool", index="state_indices", fixed_dim0=("state_pool",),
         coupled=("step_states",), required=("step_states", "state_pool", "state_indices", "num_accepted_tokens"),
         extra=DECODE_CASES[:3]),
    Spec("chunk_gated_delta_rule", _fn("cula.gated_delta_rule", "chunk_gated_delta_rule"), _gdn_base,
         required=("q", "k", "v", "g", "beta"), gates=("g", "beta"),
         extra=SCALE_CASES + UNKNOWN_KW + NO_VARLEN_CPU + (
             ("chunk_size=128", {"chunk_size": 128}, ("chunk_size",), True),
             ("head_first", {"head_first": True}, ("head_first",), True),
             ("no tokens", {"_tokens": 0}, (), None),
             ("no heads", {"_no_heads": True}, ("q", "v"), True),
         ), fla_on_gpu=True),  # fmt: skip
    Spec("chunk_gdn[fused gate]", _fn("cula.gated_delta_rule", "chunk_gdn"), _gdn_fused_gate_base,
         required=("q", "k", "v", "g", "beta"), gates=("g", "A_log", "dt_bias"), flexible_rank=("A_log", "dt_bias"),
         extra=(("fused gate without A_log", {"A_log": None}, ("A_log",), True),), fla_on_gpu=True),
    Spec("fused_recurrent_gated_delta_rule", _fn("cula.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
         _gdn_recurrent_base, gates=("g", "gk", "gv", "beta"), extra=SCALE_CASES + UNKNOWN_KW + (
             ("fused gate without g", {"g": None, "use_gate_in_kernel": True, "A_log": torch.zeros(GHV)}, ("g",),
              True),
             ("per-value beta", {"_beta_per_value": True}, (), False),
         ), fla_on_gpu=True),  # fmt: skip
    Spec("chunk_simple_gla", _fn("cula.simple_gla", "chunk_simple_gla"), _gla_base, gates=("g_gamma",),
         flexible_rank=("g_gamma",), extra=SCALE_CASES + UNKNOWN_KW + NO_VARLEN_CPU + (
             ("both g and g_gamma", {"g": torch.zeros(GB, GT, GHV)}, ("g", "g_gamma"), True),
             ("chunk_size=3", {"chunk_size": 3}, ("chunk_size",), True),
             ("no tokens", {"_tokens": 0}, (), None),
             ("no heads", {"_no_heads": True}, ("q", "v"), True),
         )),  # fmt: skip
    Spec("chunk_simple_gla[g]", _fn("cula.simple_gla", "chunk_simple_gla"), lambda d: _gla_base(d, g_gamma=False),
         gates=("g",), fla_on_gpu=True),
    Spec("chunk_simple_gla[varlen]", _fn("cula.simple_gla", "chunk_simple_gla"), _gla_varlen_base,
         gates=("g_gamma",), flexible_rank=("g_gamma",), extra=_cu_cases(True)),
    Spec("fused_recurrent_simple_gla", _fn("cula.simple_gla", "fused_recurrent_simple_gla"),
         lambda d: _gla_base(d, g_gamma=False), gates=("g",), extra=SCALE_CASES + UNKNOWN_KW, fla_on_gpu=True),
    Spec("lightning_attn_fwd", _fn("cula.lightning", "lightning_attn_fwd"), _lightning_base,
         required=("q", "k", "v", "decay"), gates=("decay",), extra=SCALE_CASES + UNKNOWN_KW + NO_VARLEN_CPU),
    Spec("chunk_lightning_attn", _fn("cula.lightning", "chunk_lightning_attn"), _lightning_layer_base,
         extra=SCALE_CASES + UNKNOWN_KW + (
             ("layer_idx past num_layers", {"layer_idx": 5}, ("layer_idx",), True),
             ("layer_idx < 0", {"layer_idx": -1}, ("layer_idx",), True),
             ("layer_idx float", {"layer_idx": 1.0}, ("layer_idx",), True),
             ("num_layers = 0", {"num_layers": 0}, ("num_layers",), True),
             ("chunk_size=3", {"chunk_size": 3}, ("chunk_size",), True),
         )),  # fmt: skip
    Spec("fused_recurrent_lightning_attn", _fn("cula.lightning", "fused_recurrent_lightning_attn"),
         _lightning_layer_base, extra=SCALE_CASES + UNKNOWN_KW + (
             ("layer_idx past num_layers", {"layer_idx": 5}, ("layer_idx",), True),
             ("num_layers str", {"num_layers": "4"}, ("num_layers",), True),
         ), fla_on_gpu=True),  # fmt: skip
    Spec("lightning_decode", _fn("cula.lightning", "lightning_decode"), _lightning_decode_base,
         inplace=("state_pool", "out"), pool="state_pool", index="state_indices", fixed_dim0=("state_pool",),
         required=("q", "k", "v", "decay", "state_pool", "state_indices"), gates=("decay",),
         extra=SCALE_CASES + UNKNOWN_KW + DECODE_CASES + (
             ("T=9 tokens", {"_tokens": 9}, ("T", "tokens"), True),
             ("no heads", {"_no_heads": True}, ("q", "v"), True),
         )),  # fmt: skip
    Spec("lightning_decode_step", _lightning_decode_step_call, _lightning_decode_base,
         inplace=("state_pool", "out"),
         pool="state_pool", index="state_indices", fixed_dim0=("state_pool",),
         required=("q", "k", "v", "decay", "state_pool", "state_indices"), gates=("decay",),
         extra=SCALE_CASES + UNKNOWN_KW + DECODE_CASES),
    Spec("lightning_g_gamma", _fn("cula.lightning", "lightning_g_gamma"),
         lambda d: dict(num_heads=4, layer_idx=1, num_layers=4, device=d), required=(), coupled=(),
         extra=UNKNOWN_KW + (
             ("num_heads = 0", {"num_heads": 0}, ("num_heads",), True),
             ("num_heads float", {"num_heads": 4.0}, ("num_heads",), True),
             ("num_heads float tensor", {"num_heads": torch.tensor(4.0)}, ("num_heads",), True),
             ("layer_idx past num_layers", {"layer_idx": 5}, ("layer_idx",), True),
             ("num_layers = 0", {"num_layers": 0}, ("num_layers",), True),
             ("num_layers None", {"num_layers": None}, ("num_layers",), True),
         )),  # fmt: skip
]


def test_every_public_function_is_fuzzed():
    """A public function added later must get a spec here."""
    import cula.gated_delta_rule
    import cula.kda
    import cula.lightning
    import cula.simple_gla

    packages = (cula.kda, cula.gated_delta_rule, cula.simple_gla, cula.lightning)
    # names re-exported from FLA as they are: FLA's functions, FLA's argument checks
    exported = {n for m in packages for n in m.__all__ if n not in getattr(m, "_FLA_ONLY", ())}
    covered = {s.name.split("[")[0] for s in SPECS} | {"chunk_gdn", "fused_recurrent_gdn"}
    assert exported <= covered, sorted(exported - covered)


def test_every_name_fla_exports_imports_from_cula():
    """The import swap (``fla.ops.X`` -> ``cula.X``) works for every public name of FLA's op packages: cula's own
    function, or FLA's where cula does not accelerate it."""
    import importlib

    pytest.importorskip("fla")
    for ours, theirs in (("kda", "kda"), ("gated_delta_rule", "gated_delta_rule"),
                         ("simple_gla", "simple_gla"), ("lightning", "lightning_attn")):  # fmt: skip
        cula_mod, fla_mod = importlib.import_module(f"cula.{ours}"), importlib.import_module(f"fla.ops.{theirs}")
        for name in fla_mod.__all__:
            fn = getattr(cula_mod, name)
            assert callable(fn), (ours, name)
            if name in getattr(cula_mod, "_FLA_ONLY", ()):
                assert fn is getattr(fla_mod, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        importlib.import_module("cula.simple_gla").nope


def test_aliases_are_the_fuzzed_functions():
    import cula.gated_delta_rule as gdn

    assert gdn.chunk_gdn is gdn.chunk_gated_delta_rule
    assert gdn.fused_recurrent_gdn is gdn.fused_recurrent_gated_delta_rule


# --------------------------------------------------------------------------------------------------------- cases
@dataclasses.dataclass
class Case:
    label: str
    mutate: Callable[[dict, str], dict]  # (a fresh base call, device) -> the variant
    names: tuple[str, ...]  # an error must name one of these (empty: any message)
    must_raise: bool
    compare: bool = True  # when accepted: the base call's result
    must_accept: bool = False  # refusing it fails the case (an input FLA's wrappers copy, and so does cula)

    def build(self, spec: Spec, device: str) -> dict:
        return self.mutate(spec.base(device), device)


def _other_device(device: str) -> str:
    return "meta" if device != "cuda" else "cpu"


def _strided(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x``'s values in a view whose stride along ``dim`` is doubled."""
    shape = list(x.shape)
    shape[dim] *= 2
    buf = torch.zeros(shape, dtype=x.dtype, device=x.device)
    view = buf[(slice(None),) * (dim % x.dim()) + (slice(None, None, 2),)]
    view.copy_(x)
    return view


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values, contiguous, one element past a 16-byte boundary."""
    buf = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    return view


def _grow(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([x, x.narrow(dim, 0, 1) if x.shape[dim] else torch.zeros_like(x.narrow(dim, 0, 0))], dim)


def _with(name, fn):
    def mutate(call, device):
        call[name] = fn(call[name], device)
        return call

    return mutate


def _special(call: dict, key: str, value) -> None:
    """The extra cases' structural edits."""
    if key == "_batch2":  # two packed batches with cu_seqlens
        for n in ("q", "k", "v", "g", "beta"):
            call[n] = torch.cat([call[n], call[n]])
    elif key == "_beta_per_value":  # beta per value channel, equal across the channels
        call["beta"] = call["beta"][..., None].expand(*call["beta"].shape, call["v"].shape[-1]).contiguous()
    elif key == "_tokens":  # every token tensor with `value` tokens
        for n in ("q", "k", "v", "g", "beta"):
            if n in call:
                call[n] = torch.cat([call[n]] * value, 1) if value else call[n][:, :0]
    elif key == "_no_heads":  # q / k / v (and what is per value head) with no heads
        for n in ("q", "k", "v", "g", "beta"):
            if n in call:
                call[n] = call[n][:, :, :0]
    else:
        raise KeyError(key)


def _updates(updates: dict):
    def mutate(call, device):
        for n, value in updates.items():
            if n.startswith("_"):
                _special(call, n, value)
                continue
            if isinstance(value, torch.Tensor) and n != "cu_seqlens_cpu" and value.device.type != "meta":
                value = value.to(device)
            call[n] = value
        return call

    return mutate


def _cases(spec: Spec) -> list[Case]:
    """Every variant of ``spec``'s base call, in a fixed order (the generator is seeded by the spec's name)."""
    rng = random.Random(zlib.crc32(spec.name.encode()))
    base = spec.base("cpu")
    tensors = [n for n, x in base.items() if isinstance(x, torch.Tensor) and n != "cu_seqlens_cpu"]
    cases = []
    for name in tensors:
        x = base[name]
        names = tuple(tensors) if name in spec.coupled else (name,)
        if name == "cu_seqlens" and "cu_seqlens_cpu" in base:
            names += ("cu_seqlens_cpu",)  # the two must agree: either may be reported
        # a consistent variant of a defining tensor is fine if its result is the base call's
        either = name in spec.coupled
        if x.is_floating_point():
            others = [d for d in OTHER_DTYPES if d != x.dtype and d != torch.float64]
            dtypes = [torch.float64, *rng.sample(others, 2)]
        else:
            dtypes = [torch.float32, torch.bool, torch.int64 if x.dtype == torch.int32 else torch.int32]
        for dt in dtypes:
            same_kind = x.is_floating_point() == dt.is_floating_point and dt != torch.bool
            cases.append(Case(f"{name}: dtype {dt}", _with(name, lambda t, d, dt=dt: t.to(dt)), names,
                              must_raise=not same_kind))  # fmt: skip
        flexible = name in spec.flexible_rank or either
        cases.append(Case(f"{name}: rank + 1", _with(name, lambda t, d: t.unsqueeze(0)), names, not flexible))
        if x.dim():
            cases.append(Case(f"{name}: rank - 1", _with(name, lambda t, d: t[..., 0]), names + spec.lower_rank_names,
                              not either))  # fmt: skip
            first = 1 if name in spec.fixed_dim0 else 0
            if first < x.dim():
                dim = rng.randrange(first, x.dim())
                cases.append(Case(f"{name}: dim {dim} + 1", _with(name, lambda t, d, dim=dim: _grow(t, dim)), names,
                                  not either))  # fmt: skip
            inner = [d for d in range(x.dim() - 1) if x.shape[d] > 1]
            if inner:
                dim = rng.choice(inner)
                cases.append(Case(f"{name}: strided dim {dim}", _with(name, lambda t, d, dim=dim: _strided(t, dim)),
                                  names, False))  # fmt: skip
            if x.dim() >= 3:  # another layout in memory, e.g. [B, H, T, D] seen as [B, T, H, D]
                a, b = sorted(rng.sample(range(x.dim() - 1), 2))

                def permuted(t, d, a=a, b=b):
                    return t.transpose(a, b).contiguous().transpose(a, b)

                label = f"{name}: dims {a} and {b} swapped in memory"
                cases.append(Case(label, _with(name, permuted), names, False))
            if x.shape[-1] > 1:  # copied where the call only reads it, as FLA's wrappers do; a written one refused
                last = _with(name, lambda t, d: _strided(t, -1))
                cases.append(Case(f"{name}: strided last dim", last, names, False,
                                  must_accept=name not in spec.inplace))  # fmt: skip
            if x.numel():
                cases.append(Case(f"{name}: misaligned", _with(name, lambda t, d: _misaligned(t)), names, False))
        cases.append(Case(f"{name}: other device", _with(name, lambda t, d: t.to(_other_device(d))), names, True))
        cases.append(Case(f"{name}: not a tensor", _with(name, lambda t, d: t.tolist()), names, True))
        if name in spec.required:
            cases.append(Case(f"{name}: None", _with(name, lambda t, d: None), names, True))
        if name in spec.gates and x.is_floating_point() and x.numel():
            for bad in (float("nan"), rng.choice([float("inf"), -float("inf")])):
                at = rng.randrange(x.numel())

                def poke(t, d, at=at, bad=bad):
                    t = t.clone()
                    t.view(-1)[at] = bad
                    return t

                cases.append(Case(f"{name}: {bad} at {at}", _with(name, poke), (), False, compare=False))
    for label, updates, names, must_raise in spec.extra:  # must_raise None: either, no result compared
        cases.append(Case(label, _updates(updates), names, bool(must_raise), compare=must_raise is not None))
    return cases


# --------------------------------------------------------------------------------------------------------- checks
def _names_argument(message: str, names: tuple[str, ...]) -> bool:
    return not names or any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


class _Snapshot:
    """What a call may not change: its input tensors, the guard bands around its in-place outputs, and the pool rows
    it does not index."""

    def __init__(self, spec: Spec, call: dict):
        self.spec = spec
        self.tensors = [
            (n, t, t.clone()) for n, t in call.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"
        ]
        self.guards = [(n, t._guard[0], t._guard[1], t.numel(), t._guard[0].clone())
                       for n, t in call.items() if hasattr(t, "_guard")]  # fmt: skip
        self.rows = None
        pool, index = call.get(spec.pool), call.get(spec.index)
        if (isinstance(pool, torch.Tensor) and isinstance(index, torch.Tensor) and pool.dim() == 4
                and "meta" not in (pool.device.type, index.device.type)):  # fmt: skip
            indexed = set(index.reshape(-1).tolist()) if not index.is_floating_point() else set()
            self.rows = (pool, [r for r in range(pool.shape[0]) if r not in indexed], pool.clone())

    def check(self, label: str, wrote: bool) -> None:
        for name, t, before in self.tensors:
            if not wrote or name not in self.spec.inplace:
                assert _same_bits(t, before), f"{label}: `{name}` was written"
        for name, buf, pad, n, before in self.guards:
            assert _same_bits(buf[:pad], before[:pad]) and _same_bits(buf[pad + n :], before[pad + n :]), (
                f"{label}: written outside `{name}`"
            )
        if self.rows is not None:
            pool, rows, before = self.rows
            assert _same_bits(pool[rows], before[rows]), f"{label}: pool rows {rows} (not indexed) were written"


def _outputs(spec: Spec, call: dict, result) -> dict[str, torch.Tensor]:
    outs = {}
    results = result if isinstance(result, (tuple, list)) else (result,)
    for i, r in enumerate(results):
        outs[f"result[{i}]"] = r
    for name in spec.inplace:
        if isinstance(call.get(name), torch.Tensor):
            outs[name] = call[name]
    return outs


def _compare(label: str, got: dict, expected: dict, ratio: float) -> None:
    from cula.testing import rel_rmse

    assert got.keys() == expected.keys(), (label, sorted(got), sorted(expected))
    for key, ref in expected.items():
        out = got[key]
        if ref is None or not isinstance(ref, torch.Tensor):
            assert out is None or out == ref, f"{label}: {key} is {out!r}, the base call's {ref!r}"
            continue
        assert isinstance(out, torch.Tensor) and out.shape == ref.shape, f"{label}: {key} shape"
        out, ref = out.detach().cpu(), ref.detach().cpu()
        assert bool(torch.isfinite(out.double()).all()), f"{label}: {key} has non-finite values"
        # a NaN in the reference would make the difference below NaN, and NaN > 1e-6 skip the comparison
        assert bool(torch.isfinite(ref.double()).all()), f"{label}: {key}'s reference has non-finite values"
        if ref.numel() and (out.double() - ref.double()).abs().max() > 1e-6:
            err = rel_rmse(ref, out)
            assert err < ratio, f"{label}: {key} is not the base call's reference result (rel. RMSE {err:.2e})"


def _clone_outputs(outs: dict) -> dict:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in outs.items()}


@dataclasses.dataclass
class Outcome:
    label: str
    kind: str  # raised / unavailable / routed / accepted
    events: tuple


def _run_case(spec: Spec, case: Case, device: str, events: list, expected: dict | None, ratio: float) -> Outcome:
    call = case.build(spec, device)
    snap = _Snapshot(spec, call)
    events.clear()
    try:
        with torch.no_grad():
            result = spec.call(call)
    except Routed:  # validation comes before any backend, FLA's included
        assert not case.must_raise, f"{case.label}: accepted and sent on (ran {events})"
        snap.check(case.label, wrote=False)
        return Outcome(case.label, "routed", tuple(events))
    except (TypeError, ValueError, BackendUnavailableError) as err:
        assert not case.must_accept, f"{case.label}: refused ({err})"
        assert not events, f"{case.label}: raised {err!r} after running {events}"
        snap.check(case.label, wrote=False)
        if not isinstance(err, BackendUnavailableError):
            assert _names_argument(str(err), case.names), f"{case.label}: names none of {case.names}: {err}"
        return Outcome(case.label, "unavailable" if isinstance(err, BackendUnavailableError) else "raised", ())
    assert not case.must_raise, f"{case.label}: accepted (ran {events})"
    snap.check(case.label, wrote=True)
    launched = any(e[0] == "kernel" for e in events)
    if case.compare and expected is not None and not launched:
        _compare(case.label, _outputs(spec, call, result), expected, ratio)
    return Outcome(case.label, "accepted", tuple(events))


def _expected(spec: Spec, device: str, monkeypatch) -> dict | None:
    """The base call's outputs from the reference backends (None where they cannot run it)."""
    call = spec.base(device)
    with monkeypatch.context() as m:
        m.setenv("CULA_BACKEND", "reference")
        try:
            with torch.no_grad():
                return _clone_outputs(_outputs(spec, call, spec.call(call)))
        except BackendUnavailableError:
            return None


# --------------------------------------------------------------------------------------------------------- fixtures
def _registries():
    from cula.gated_delta_rule.backends import chunk_gdn_registry, fused_recurrent_gdn_registry
    from cula.kda.backends import chunk_kda_registry, fused_recurrent_kda_registry
    from cula.kda.decode import kda_decode_registry
    from cula.lightning.decode import lightning_decode_registry
    from cula.simple_gla.backends import chunk_simple_gla_registry, fused_recurrent_simple_gla_registry

    return (chunk_kda_registry, fused_recurrent_kda_registry, kda_decode_registry, chunk_gdn_registry,
            fused_recurrent_gdn_registry, chunk_simple_gla_registry, fused_recurrent_simple_gla_registry,
            lightning_decode_registry)  # fmt: skip


@pytest.fixture
def recorded(monkeypatch):
    """Every backend run is recorded; with ``routed_fla`` FLA's backends record and raise ``Routed`` instead of
    running. Plan caches start and end empty (their launches hold the stubs)."""
    events: list = []
    state = {"routed_fla": False}

    def recording(registry, backend):
        run = backend.run

        def wrapped(**args):
            events.append(("run", registry.op, backend.name))
            if backend.name == "fla" and state["routed_fla"]:
                raise Routed(registry.op)
            return run(**args)

        return dataclasses.replace(backend, run=wrapped)

    for registry in _registries():
        monkeypatch.setattr(registry, "_backends", [recording(registry, b) for b in registry._backends])
        monkeypatch.setattr(registry, "_logged", set())
    clear_plan_caches()
    yield events, state
    clear_plan_caches()


_CUTE_DTYPES = {"BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32,
                "Int32": torch.int32, "Int64": torch.int64}  # fmt: skip


# launches that flatten (B, T, ...) token tensors with dim 1's stride (their argument positions): their entries take
# the batch and token strides as free sizes, so a layout they misread passes TVM-FFI's checks
_FLAT_TOKENS = {"ChunkKDAFwdSm90": (0, 1, 2, 3, 4, 8)}
_MISREADS: list[str] = []  # launches the entry would take and the kernel misread (fake_kernels fails on any)


def _check_launch(kernel: str, fakes: tuple, args: tuple) -> None:
    """The checks TVM-FFI makes of a launch's arguments against the compile-time fakes (a compact fake's strides
    that depend on symbolic sizes are free symbols there, checked for divisibility only), and a few more: finite
    scalars, and the token layouts a flattening kernel misreads (``_FLAT_TOKENS``)."""
    params = [f for f in fakes if type(f).__name__ != "_FakeStream"]
    assert len(args) == len(params), f"{kernel}: {len(args)} arguments for {len(params)} parameters"
    sizes, device, misread = {}, None, []
    for i, (fake, arg) in enumerate(zip(params, args)):
        where = f"{kernel} argument {i}"
        if fake is None:
            assert arg is None, f"{where}: the variant takes None"
        elif hasattr(fake, "element_type") and hasattr(fake, "_assumed_align"):
            assert isinstance(arg, torch.Tensor), f"{where}: {type(arg).__name__}, not a tensor"
            want = _CUTE_DTYPES[getattr(fake.element_type, "__name__", str(fake.element_type))]
            assert arg.dtype == want, f"{where}: dtype {arg.dtype}, compiled for {want}"
            assert arg.dim() == len(fake.shape), f"{where}: rank {arg.dim()}, compiled for {len(fake.shape)}"
            for d, (size, stride) in enumerate(zip(fake.shape, fake.stride)):
                n = arg.shape[d]
                if isinstance(size, int):
                    assert n == size, f"{where}: dim {d} is {n}, compiled for {size}"
                else:
                    seen = sizes.setdefault(id(size), n)
                    assert seen == n, f"{where}: dim {d} is {n}, another argument's {seen}"
                    assert n % size.divisibility == 0, f"{where}: dim {d} = {n}, not a multiple of {size.divisibility}"
                if n == 1:
                    pass  # TVM-FFI checks no stride of a size-1 dim (PyTorch gives those any value)
                elif isinstance(stride, int):
                    assert arg.stride(d) == stride, f"{where}: stride {arg.stride()}, compiled for {fake.stride}"
                else:
                    assert arg.stride(d) % stride.divisibility == 0, f"{where}: {arg.stride()} vs {fake.stride}"
            if kernel in _FLAT_TOKENS and i in _FLAT_TOKENS[kernel]:
                # what the entry does not check but the kernel assumes: token b T + t at (b T + t) dim-1 strides
                # (recorded, not raised: a launch that raises is taken for the entry refusing, and validated in full)
                B, T = arg.shape[:2]
                if B != 1 and arg.stride(0) != T * arg.stride(1):
                    misread.append(f"{where}: strides {arg.stride()} of {list(arg.shape)}")
            assert arg.data_ptr() % fake._assumed_align == 0, f"{where}: not {fake._assumed_align}-byte aligned"
            assert device in (None, arg.device), f"{where}: on {arg.device}, another argument on {device}"
            device = arg.device
        else:
            assert type(arg) in (int, float), f"{where}: {type(arg).__name__}, a {type(fake).__name__} scalar"
            if "Float" in type(fake).__name__:
                assert math.isfinite(arg), f"{where}: scalar {arg}"
    _MISREADS.extend(misread)  # every check above passed: the entry would launch


@pytest.fixture
def fake_kernels(monkeypatch, pretend_sm90, recorded):
    """CPU tensors select the cula-sm90 backends; ``cute.compile`` returns a launch recorder that checks its
    arguments against the kernel's fakes (``_check_launch``); FLA's backends are recorded and stop (``Routed``)."""
    import cutlass.cute
    import cutlass.cute.runtime

    import cula.cache
    import cula.ops.kda.sm90.decode_kernel
    import cula.ops.lightning.sm90.chunk_fwd_kernel
    import cula.ops.lightning.sm90.decode_kernel

    events, state = recorded
    state["routed_fla"] = True
    monkeypatch.setattr(cula.cache, "_CACHE", {})  # no real kernel compiled by an earlier test, no stub kept after
    def compile(kernel, *fakes, options=None):
        name = type(kernel).__name__

        def launch(*args):
            _check_launch(name, fakes, args)
            events.append(("kernel", name))

        return launch

    monkeypatch.setattr(cutlass.cute, "compile", compile)
    _MISREADS.clear()
    yield events
    assert not _MISREADS, "launched with token layouts the kernel misreads:\n" + "\n".join(_MISREADS)


# --------------------------------------------------------------------------------------------------------- tests
def _fuzz(spec: Spec, device: str, events: list, monkeypatch, cases: list[Case], ratio: float):
    """The base call (which builds the plans every case then follows), then every case; all failures at once."""
    base_events, expected = (), None
    if not all(c.must_raise for c in cases):  # (else no result is compared, and on the GPU FLA would compile)
        call = spec.base(device)
        events.clear()
        try:
            with torch.no_grad():
                spec.call(call)
        except Routed:
            pass
        base_events = tuple(events)
        expected = _expected(spec, device, monkeypatch)
    if expected is None and device != "cpu" and base_events and not any(e[0] == "kernel" for e in base_events):
        with torch.no_grad():  # no reference for this form: the base call's own result
            call = spec.base(device)
            expected = _clone_outputs(_outputs(spec, call, spec.call(call)))
    outcomes, failures = [], []
    for case in cases:
        try:
            outcomes.append(_run_case(spec, case, device, events, expected, ratio))
        except AssertionError as err:
            failures.append(str(err).splitlines()[0])
        except Exception as err:  # a crash: anything but the documented errors
            failures.append(f"{case.label}: {type(err).__name__}: {err}".splitlines()[0])
    assert not failures, f"{spec.name}: {len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)
    return base_events, outcomes


def _by_kind(outcomes: list[Outcome]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    return kinds


@pytest.mark.parametrize("spec", [s for s in SPECS if "cpu" in s.modes], ids=lambda s: s.name)
def test_cpu(spec, recorded, monkeypatch):
    """CPU tensors on the CPU's backends: every variant refused with a named error before any backend ran, or
    accepted with the base call's result, and nothing written outside the call's outputs."""
    events, _ = recorded
    for op, size in HEAD_DIMS_CPU.items():
        monkeypatch.setitem(HEAD_DIMS, op, size)
    _, outcomes = _fuzz(spec, "cpu", events, monkeypatch, _cases(spec), ratio=5e-3)
    kinds = _by_kind(outcomes)
    assert kinds.get("raised", 0) > len(outcomes) // 3, kinds  # the fuzz must mostly find bad input
    assert kinds.get("unavailable", 0) == 0, [o.label for o in outcomes if o.kind == "unavailable"]


@pytest.mark.parametrize("spec", [s for s in SPECS if "cuda_path" in s.modes], ids=lambda s: s.name)
def test_cuda_path(spec, fake_kernels, monkeypatch, caplog):
    """The same variants through the CUDA dispatch: refused before any launch, or launched with arguments that the
    kernel's compiled signature takes (``_check_launch``), or sent to a backend that supports them with the reason
    the cula-sm90 backend declined logged."""
    caplog.set_level(logging.INFO, logger="cula")
    base_events, outcomes = _fuzz(spec, "cpu", fake_kernels, monkeypatch, _cases(spec), ratio=5e-3)
    assert not [o.label for o in outcomes if o.kind == "unavailable"]  # some backend takes every valid call
    on_kernels = any(e[0] == "kernel" for e in base_events)
    declined = "\n".join(r.getMessage() for r in caplog.records)
    for o in outcomes:
        elsewhere = any(e[0] == "run" and e[2] != "cula-sm90" for e in o.events)
        if on_kernels and elsewhere and not any(e[0] == "kernel" for e in o.events):
            assert "cula-sm90: " in declined, f"{o.label}: ran {o.events} without a logged reason"


def test_cuda_path_reaches_the_kernels(fake_kernels, monkeypatch):
    """The base calls of the functions with cula kernels do launch them (else test_cuda_path would prove little)."""
    launched = set()
    for spec in SPECS:
        if "cuda_path" not in spec.modes:
            continue
        fake_kernels.clear()
        try:
            with torch.no_grad():
                spec.call(spec.base("cpu"))
        except Routed:
            continue
        if any(e[0] == "kernel" for e in fake_kernels):
            launched.add(spec.name)
    assert launched >= {
        "chunk_kda", "chunk_kda[log-space gate]", "chunk_kda[varlen]", "fused_recurrent_kda_fwd[pool]", "kda_decode",
        "kda_decode[mtp, step_states]", "kda_decode_step", "chunk_simple_gla", "chunk_simple_gla[varlen]",
        "lightning_attn_fwd", "chunk_lightning_attn", "lightning_decode", "lightning_decode_step",
    }, launched  # fmt: skip


@pytest.mark.parametrize("name", ["kda_decode_step", "gdn_decode_step", "lightning_decode_step"])
@pytest.mark.parametrize("path", ["cpu", "cuda_path"])
def test_step_closures_refuse_bad_steps(name, path, request):
    """A step closure keeps its plans by token signature: after a good step, every bad token variant is still
    refused before anything runs, and slot indices rewritten in place out of range are caught by the index check."""
    from cula.gated_delta_rule import gdn_decode_step
    from cula.kda import kda_decode_step
    from cula.lightning import lightning_decode_step

    if path == "cuda_path":
        events = request.getfixturevalue("fake_kernels")
    else:
        events = request.getfixturevalue("recorded")[0]
    spec = next(s for s in SPECS if s.name == name)
    token_names = ("q", "k", "v", "g", "beta", "out")
    call = spec.base("cpu")
    tokens = {n: call.pop(n) for n in token_names if n in call}
    pool, idx = call["state_pool"], call["state_indices"]
    if name in ("kda_decode_step", "gdn_decode_step"):
        make = kda_decode_step if name == "kda_decode_step" else gdn_decode_step
        step = make(call.pop("state_pool"), call.pop("state_indices"), **call)
    else:
        step = lightning_decode_step(call.pop("decay"), call.pop("state_pool"), call.pop("state_indices"), **call)
    with torch.no_grad():
        step(**tokens)
        refused = 0
        for case in _cases(spec):
            if not case.must_raise or case.label.split(":")[0] not in token_names:
                continue
            bad = case.build(spec, "cpu")
            before, events[:] = pool.clone(), []
            with pytest.raises((TypeError, ValueError)) as err:
                step(**{n: bad[n] for n in tokens})
            assert _names_argument(str(err.value), case.names), (case.label, str(err.value))
            assert not events and torch.equal(pool, before), case.label
            refused += 1
        assert refused >= 15
        idx[0] = pool.shape[0]  # an engine rewriting its slots in place
        with pytest.raises(ValueError, match="state_indices"):
            step(**tokens)
        idx[0] = DECODE_ROWS[0]
        step(**tokens)


def _gpu_cases(spec: Spec) -> list[Case]:
    """A short list for the GPU: every refused case of the kinds below (they cost no device time), and the accepted
    ones that run on the base call's compiled kernels or the torch reference, with no compile of their own."""
    extra = {label for label, *_ in spec.extra}
    refused = ("dtype torch.float64", "other device", "rank + 1", "not a tensor")
    picked = []
    for case in _cases(spec):
        label = case.label
        if case.must_raise:
            if label in extra or any(kind in label for kind in refused):
                picked.append(case)
        elif spec.fla_on_gpu or label.startswith(spec.gpu_skip):
            continue
        elif label in extra or " at " in label:  # accepted extras, non-finite gates
            picked.append(case)
        elif label == "g: dtype torch.float64" and spec.name in ("chunk_kda", "kda_decode"):
            picked.append(case)  # FLA's kernels (chunk_kda) and the reference (kda_decode) run it
        elif spec.gpu_layouts and any(kind in label for kind in ("misaligned", "strided", "swapped")):
            picked.append(case)
    return picked


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [s for s in SPECS if "gpu" in s.modes], ids=lambda s: s.name)
def test_gpu(spec, recorded, monkeypatch):
    """CUDA tensors on an SM90 GPU, for real: refused before anything runs, or the reference's result; nothing
    written outside the outputs (guard bands around them, the pool rows not indexed), no device error."""
    events, _ = recorded
    _, outcomes = _fuzz(spec, "cuda", events, monkeypatch, _gpu_cases(spec), ratio=5e-3)
    torch.cuda.synchronize()  # a kernel fault would surface here, if not at one of the checks' reads
    assert not [o.label for o in outcomes if o.kind == "unavailable"]


def test_token_layouts_a_repeated_chunk_kda_call_would_misread(fake_kernels):
    """After a row-major call has cached its launch, the same shapes in layouts the fixed-length entry takes but
    its flat token layout misreads (a slice in time, batch and time swapped in memory, one token whose dim-1 stride
    is not the batch stride) go the general way, which copies them: ``fake_kernels`` fails on a misread launch."""

    def relaid(tokens):  # batch and time swapped in memory (fresh strides, size-1 dims' too), same values
        return {n: t.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(0, 1)
                for n, t in tokens.items()}  # fmt: skip

    base = _chunk_kda_base("cpu")
    one = dict(base, **_kda_tokens("cpu", T=1))
    sliced = {n: t[:, :KT] for n, t in _kda_tokens("cpu", T=2 * KT).items()}
    one_relaid = relaid(_kda_tokens("cpu", T=1))
    # is_contiguous() and TVM-FFI alike ignore the stride of a size-1 dim, which the flat layout steps tokens by
    assert one_relaid["q"].is_contiguous() and one_relaid["q"].stride(1) != one_relaid["q"].stride(0)
    for call, layouts in ((base, (sliced, relaid(_kda_tokens("cpu")))), (one, (one_relaid,))):
        for tokens in ({}, *layouts):  # the row-major call first: it caches the launch the others would find
            try:
                with torch.no_grad():
                    _fn("cula.kda", "chunk_kda")(dict(call, **tokens))
            except Routed:
                pass  # FLA's kernels take it: no misread either


def test_float64_gates_run_where_they_are_supported(fake_kernels, caplog):
    """FLA 0.6.0 takes a float64 gate (its kernels compute in fp32) and so does validation; the CuTe kernels are
    compiled for bf16/fp16/fp32 only, so such calls go to FLA (chunk_kda) or the reference (kda_decode), with the
    reason logged, instead of failing in the launcher on a dtype its kernel map lacks."""
    caplog.set_level(logging.INFO, logger="cula")
    call = _chunk_kda_base("cpu")
    with torch.no_grad(), pytest.raises(Routed):
        _fn("cula.kda", "chunk_kda")(dict(call, g=call["g"].double()))
    assert "cula-sm90: g dtype torch.float64" in caplog.text
    fake_kernels.clear()
    call = _kda_decode_base("cpu")
    with torch.no_grad():
        _fn("cula.kda", "kda_decode")(dict(call, g=call["g"].double()))
    assert fake_kernels == [("run", "kda.kda_decode", "reference")]
    assert "cula-sm90: g dtype torch.float64" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["kda", "lightning"])
@pytest.mark.parametrize("state_v_first", [True, False], ids=["vk", "kv"])
def test_unchecked_index_past_the_pool_writes_nothing_outside_gpu(op, state_v_first):
    """``check_indices=False`` with an index past the pool: the pool is a view of a larger buffer, and the rows
    behind it (and every pool row no sequence owns) keep their bits; the other sequences match the reference. The
    register kernels skip such a slot ([V, K] pools at T=1), the TMA box kernels' accesses are clipped to the pool
    ([K, V] pools)."""
    from cula.kda import kda_decode
    from cula.lightning import lightning_decode

    dev, N, H, HV, D, P = "cuda", 3, 1, 2, 128, 4
    gen = torch.Generator(dev).manual_seed(11)

    def rnd(*shape, dtype=torch.bfloat16, s=1.0):
        return (s * torch.randn(*shape, generator=gen, device=dev)).to(dtype)

    buffer = rnd(P + 3, HV, D, D, dtype=torch.float32, s=0.1)
    pool = buffer[:P]
    before = buffer.clone()
    idx = torch.tensor([2, P + 1, 0], dtype=torch.int32, device=dev)
    q, k, v = rnd(N, 1, H, D), rnd(N, 1, H, D), rnd(N, 1, HV, D)
    if op == "kda":
        g, beta = rnd(N, 1, HV, D, dtype=torch.float32), rnd(N, 1, HV, dtype=torch.float32)
        run = lambda pool_, idx_: kda_decode(q, k, v, g, beta, pool_, idx_, lower_bound=-5.0,  # noqa: E731
                                             state_v_first=state_v_first, check_indices=False)  # fmt: skip
    else:
        decay = torch.linspace(0.1, 1.0, HV, device=dev)
        run = lambda pool_, idx_: lightning_decode(q, k, v, decay, pool_, idx_,  # noqa: E731
                                                   state_v_first=state_v_first, check_indices=False)  # fmt: skip
    o = run(pool, idx)
    torch.cuda.synchronize()
    assert torch.equal(buffer[P:].view(torch.int32), before[P:].view(torch.int32)), "rows behind the pool changed"
    for row in (1, 3):  # no sequence owns them
        assert torch.equal(buffer[row].view(torch.int32), before[row].view(torch.int32)), f"pool row {row} changed"
    # the sequences with valid slots, against the same call with the bad one marked padded
    ref_pool = before[:P].clone()
    o_ref = run(ref_pool, torch.tensor([2, -1, 0], dtype=torch.int32, device=dev))
    torch.cuda.synchronize()
    assert torch.isfinite(o[[0, 2]]).all()  # rows left poisoned by both calls would match bit for bit
    assert torch.equal(o[[0, 2]].view(torch.int16), o_ref[[0, 2]].view(torch.int16))
    assert torch.equal(pool.view(torch.int32), ref_pool.view(torch.int32))
