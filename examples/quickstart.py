"""Quickstart: chunked KDA forward and backward through cula, checked against the float64 reference.

Runs on the GPU when there is one (cula picks its kernels, or FLA's where ours do not cover the call)
and on the CPU reference path otherwise. Prints the backend used, the error and the time.
"""

import logging
import time

import torch

import cula.kda
from cula.kda.backends import chunk_kda_registry
from cula.kda.naive import kda_gate, l2norm, naive_recurrent_kda
from cula.testing import rel_rmse


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    B, T, H, D = (2, 2048, 8, 128) if device == "cuda" else (1, 256, 2, 64)
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(B, T, H, D, device=device, dtype=dtype) for _ in range(4))
    beta = torch.randn(B, T, H, device=device, dtype=torch.float32)
    A_log = torch.randn(H, device=device) * 0.5
    dt_bias = torch.randn(H * D, device=device) * 0.5
    h0 = torch.randn(B, H, D, D, device=device) * 0.1
    for t in (q, k, v, g, beta):
        t.requires_grad_()
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)

    backend = chunk_kda_registry.select(q.device, dict(
        q=q, k=k, v=v, g=g, beta=beta, cp_context=None, use_graph=False, return_intermediate_states=False,
        **kw)).name
    o, ht = cula.kda.chunk_kda(q, k, v, g, beta, **kw)  # first call: compiles / autotunes
    (o.float().sum() + ht.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    o, ht = cula.kda.chunk_kda(q, k, v, g, beta, **kw)
    (o.float().sum() + ht.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) * 1e3

    # Inference (no autograd): on Hopper this is where cula's own kernels run.
    with torch.inference_mode():
        infer_backend = chunk_kda_registry.select(q.device, dict(
            q=q, k=k, v=v, g=g, beta=beta, cp_context=None, use_graph=False, return_intermediate_states=False,
            **kw)).name
        cula.kda.chunk_kda(q, k, v, g, beta, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        o_inf, ht_inf = cula.kda.chunk_kda(q, k, v, g, beta, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        infer_ms = (time.perf_counter() - start) * 1e3

    with torch.no_grad():
        gate = kda_gate(g.double(), A_log.double(), dt_bias.double(), lower_bound=-5.0)
        ro, rt = naive_recurrent_kda(l2norm(q.double()), l2norm(k.double()), v.double(), gate,
                                     beta.double().sigmoid(), initial_state=h0.double(), output_final_state=True)
    print(f"device={device} shape B={B} T={T} H={H} D={D} {str(dtype).removeprefix('torch.')}")
    print(f"relative RMSE vs float64 reference: o {rel_rmse(ro, o):.2e}, final state {rel_rmse(rt, ht):.2e}")
    print(f"training forward + backward ({backend}): {elapsed:.2f} ms; grad norms q {q.grad.norm():.3e} "
          f"g {g.grad.norm():.3e}")
    print(f"inference forward ({infer_backend}): {infer_ms:.2f} ms; relative RMSE o {rel_rmse(ro, o_inf):.2e}, "
          f"final state {rel_rmse(rt, ht_inf):.2e}")


if __name__ == "__main__":
    main()
