"""Where chunk_kda's (B1-T256 inference) and kda_decode's (N=1) host time per call goes on the device machine.

    device run, carry [".device"]:  bash scripts/device/run.sh python scripts/device/host_breakdown.py

Times, per call, each piece of a repeated fixed-length ``cula.kda.chunk_kda`` call on its own (the plan key's
tensor signatures, the bound launch's three allocations, its one TVM-FFI call for both kernels, and for comparison
each kernel's own call as the general path makes them) against the whole call: host time only (each call starts
with the GPU idle and is timed until it returns). Prints a table and writes $OUT/host_breakdown.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from common import measure_host_overhead  # the benchmarks' helpers live beside their scripts

B, T, H, D = 1, 256, 64, 128
FLAGS = {"output_final_state": True, "use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True,
         "use_beta_sigmoid_in_kernel": True, "safe_gate": True, "lower_bound": -5.0, "state_v_first": True}


def per_call_us(fn) -> float:
    """Median host microseconds of one call, each issued with the GPU idle and timed until it returns (the
    benchmarks' ``measure_host_overhead``; timing back-to-back calls instead measures max(host, GPU) per call,
    and at B1-T256 the kernels take longer than their launches)."""
    return measure_host_overhead(fn, n=400)["host_us"]


def main() -> None:
    from cula.backends import tensor_sig
    from cula.kda import chunk_kda
    from cula.ops.kda.sm90 import delta_h_fwd_o as dh
    from cula.ops.kda.sm90 import fwd_launch, intra

    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    x = {n: torch.randn(B, T, H, D, dtype=bf16, device=dev) for n in ("q", "k", "v", "g")}
    x.update(beta=torch.randn(B, T, H, dtype=bf16, device=dev), A_log=torch.randn(H, device=dev),
             dt_bias=torch.randn(H * D, device=dev), initial_state=0.01 * torch.randn(B, H, D, D, device=dev))
    rows = {}
    with torch.inference_mode():
        rows["chunk_kda (whole call, plan cached)"] = per_call_us(lambda: chunk_kda(**x, **FLAGS))
        tensors = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")]
        rows["plan key: 8 tensor_sig"] = per_call_us(lambda: [tensor_sig(t) for t in tensors])

        HV, K, V, BT, NC = H, D, D, B * T, (T + 63) // 64
        fn = fwd_launch.get_compiled(
            intra.kernel_options(bf16, bf16, bf16, "sigmoid", True, "sigmoid", g_cum_last_only=True),
            dict(dtype=intra._TORCH_TO_CUTLASS[bf16], has_initial_state=True, has_final_state=True,
                 state_v_first=True, aqk_causal=True),
        )  # fmt: skip

        def allocs():
            return (
                torch.empty(BT * HV, fwd_launch.WORK_COLS, dtype=bf16, device=dev),
                torch.empty(B, T, HV, V, dtype=bf16, device=dev),
                torch.empty(B, HV, V, K, dtype=torch.float32, device=dev),
            )

        rows["3 torch.empty (workspace, o, final state)"] = per_call_us(allocs)
        q = x["q"]
        rows["1 torch.empty(shape, dtype=, device=)"] = per_call_us(
            lambda: torch.empty(B, T, HV, V, dtype=bf16, device=dev)
        )
        rows["1 q.new_empty(shape)"] = per_call_us(lambda: q.new_empty((B, T, HV, V)))
        rows["1 torch.empty_like(q)"] = per_call_us(lambda: torch.empty_like(q))
        work, o, ht = allocs()
        no_cu = torch.zeros(2, dtype=torch.int32, device=dev)
        both = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], work, o, x["initial_state"], ht,
                no_cu, D**-0.5, -5.0)  # fmt: skip
        rows["both stages' host call (fwd_launch, 14 args)"] = per_call_us(lambda: fn(*both))

        # the two-call form the general path (and segmented B = 1 calls) still make, for comparison
        w, u, qg, kg = torch.empty(4, BT, HV, K, dtype=bf16, device=dev).unbind(0)
        Aqk = torch.empty(BT, HV, 64, dtype=bf16, device=dev)
        g_cum = torch.empty(BT, HV, K, dtype=torch.float32, device=dev)
        no_ci = torch.zeros(1, 2, dtype=torch.int32, device=dev)
        fn_intra = intra.compiled_for(bf16, bf16, bf16, "sigmoid", False, True, "sigmoid", g_cum_last_only=True)
        intra_args = (
            x["q"].view(BT, H, K), x["k"].view(BT, H, K), x["v"].view(BT, HV, V), x["g"].view(BT, HV, K),
            x["beta"].view(BT, HV), x["A_log"], x["dt_bias"].view(HV, K), w, u, qg, kg, Aqk, None, g_cum, no_cu, no_ci,
            T, NC, B, D**-0.5, -5.0,
        )  # fmt: skip
        rows["intra kernel call alone (21 args)"] = per_call_us(lambda: fn_intra(*intra_args))
        fn_state = dh.get_compiled(dtype=dh._TORCH_TO_CUTLASS[bf16], varlen=False, has_h0=True, has_ht=True,
                                   state_v_first=True, aqk_causal=True)  # fmt: skip
        state_args = (w, u, kg, qg, g_cum, Aqk, o.view(BT, HV, V), x["initial_state"], ht, no_cu, T, B, D**-0.5)
        rows["state kernel call alone (13 args)"] = per_call_us(lambda: fn_state(*state_args))
        rows["5 tensor views"] = per_call_us(lambda: (x["q"].view(BT, H, K), x["k"].view(BT, H, K),
                                                      x["v"].view(BT, HV, V), x["g"].view(BT, HV, K),
                                                      x["beta"].view(BT, HV)))  # fmt: skip
        rows.update(varlen_rows(x))
        rows.update(decode_rows())
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:7.1f} us/call", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "host_breakdown.json"), "w") as f:
        json.dump({k: round(v, 2) for k, v in rows.items()}, f, indent=1)


def varlen_rows(x: dict) -> dict[str, float]:
    """A packed call of the same 256 tokens as 4 sequences, through the general path and through a varlen plan
    (``cula.kda.chunk.VARLEN_PLANS``)."""
    import cula.kda.chunk as chunk_mod
    from cula.kda import chunk_kda

    cu = torch.tensor([0, 50, 120, 200, T], dtype=torch.int32)
    xv = dict(x, initial_state=x["initial_state"].expand(4, -1, -1, -1).contiguous())
    call = dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    rows, switch = {}, chunk_mod.VARLEN_PLANS
    try:
        for on in (False, True):
            chunk_mod.VARLEN_PLANS = on
            name = f"chunk_kda varlen N=4 ({'a plan' if on else 'general path'})"
            rows[name] = per_call_us(lambda: chunk_kda(**xv, **FLAGS, **call))
    finally:
        chunk_mod.VARLEN_PLANS = switch
    return rows


def decode_rows() -> dict[str, float]:
    """The same split for one kda_decode step at N=1 (issue 4's 15 us per call target)."""
    from cula.backends import tensor_sig
    from cula.kda import kda_decode
    from cula.ops.kda.sm90.decode import kda_decode_launcher

    torch.manual_seed(0)
    N, HV, dev, bf16 = 1, 64, "cuda", torch.bfloat16
    q, k = (torch.randn(N, 1, 16, D, dtype=bf16, device=dev) for _ in range(2))
    v, g = (torch.randn(N, 1, HV, D, dtype=bf16, device=dev) for _ in range(2))
    beta = torch.randn(N, 1, HV, dtype=bf16, device=dev)
    pool = torch.randn(4, HV, D, D, device=dev) * 0.01
    idx = torch.tensor([1], dtype=torch.int32, device=dev)
    A_log, dt_bias = torch.randn(HV, device=dev), torch.randn(HV * D, device=dev)
    out = torch.empty(N, 1, HV, D, dtype=bf16, device=dev)
    rows = {"kda_decode N=1 (whole call, plan cached)": per_call_us(lambda: kda_decode(
        q, k, v, g, beta, pool, idx, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, check_indices=False))}  # fmt: skip
    tensors = (q, k, v, g, beta, pool, idx, A_log, dt_bias, out, None)
    rows["kda_decode: 11 tensor_sig"] = per_call_us(lambda: [tensor_sig(t) for t in tensors])
    launch = kda_decode_launcher(
        io_dtype=bf16, g_dtype=bf16, beta_dtype=bf16, K=D, V=D, gate="lower_bound", has_a_log=True,
        has_dt_bias=True, use_qk_l2norm=True, beta_sigmoid=True, allow_neg_eigval=False, state_v_first=True,
        has_step_states=False,
    )  # fmt: skip
    rows["kda_decode: kernel call (13 args)"] = per_call_us(
        lambda: launch(q, k, v, g, beta, A_log, dt_bias, pool, idx, out, None, D**-0.5, -5.0)
    )
    rows["torch.empty_like(v)"] = per_call_us(lambda: torch.empty_like(v))
    # TVM-FFI converts torch tensors through torch's DLPack exchange API when torch has it (fast), else through
    # torch.utils.dlpack (slow); 1.0 = present
    import tvm_ffi  # noqa: F401 - installs the attribute where it can

    rows["torch.Tensor.__dlpack_c_exchange_api__ present"] = float(hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
    return rows


if __name__ == "__main__":
    main()
