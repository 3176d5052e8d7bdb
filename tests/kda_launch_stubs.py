"""KDA's forward kernels stubbed on the CPU: each records what it is handed, and ``fwd_launch``'s one host call for
both is emulated in torch (the views and workspace regions ``ChunkKDAFwdSm90`` hands its two kernels), so that a
bound launch can be held to the general path argument by argument (``tests/test_chunk_plans.py``,
``tests/test_gdn_plans.py``; their GPU tests compare the outputs bit for bit)."""

from __future__ import annotations

import functools

import torch

from cula.ops._host import ROW_FACTORS


def stub_kernels(monkeypatch) -> list:
    """Install the stubs; returns the list of ``(kernel, compile keywords, arguments)`` they append to."""
    from cula.ops.kda.sm90 import delta_h_fwd_o, fwd_launch, intra

    calls = []
    monkeypatch.setattr(intra, "compiled_variant", lambda **kw: lambda *a: calls.append(("intra", kw, a)))
    monkeypatch.setattr(delta_h_fwd_o, "compiled_variant", lambda **kw: lambda *a: calls.append(("state", kw, a)))
    monkeypatch.setattr(fwd_launch, "compiled_variant", lambda io, so, varlen=False: functools.partial(
        both_stages, calls, io, so, varlen))  # fmt: skip
    return calls


def both_stages(calls, io, so, varlen, q, k, v, g, beta, a_log, bias, work, o, h0, ht, cu, *rest):
    """What ``fwd_launch.ChunkKDAFwdSm90`` (``ChunkKDAVarlenFwdSm90``) hands its two kernels, in torch: flat views of
    the inputs, and the workspace's regions of B T HV rows each (w, u, qg, kg, Aqk, then g_cum's fp32; with row
    factors w, u, Aqk, then the factors' fp32; with wy_in_recurrence T diag(beta), Aqk, the factors)."""
    from cula.ops.kda.sm90.fwd_launch import work_cols

    ci, scale, lb = rest if varlen else (cu.view(1, 2), *rest)
    B_, T_, H_, K_ = q.shape
    HV_ = v.shape[2]
    rows_factors, wy = bool(io.get("row_factors")), bool(io.get("wy_in_recurrence"))
    rows = B_ * T_ * HV_
    assert work.shape == (rows, work_cols(io)) and work.dtype == q.dtype
    assert bias.shape == ((HV_,) if rows_factors else (HV_ * K_,))
    assert wy == bool(so.get("wy_in_recurrence"))
    q3, k3, v3, o3 = (x.view(B_ * T_, *x.shape[2:]) for x in (q, k, v, o))
    intra_kw = dict(io, varlen=varlen)
    state_kw = dict(dtype=so["dtype"], varlen=varlen, has_h0=so["has_initial_state"], has_ht=so["has_final_state"],
                    state_v_first=so["state_v_first"], aqk_causal=so["aqk_causal"],
                    **({"row_factors": True} if so.get("row_factors") else {}),
                    **({"wy_in_recurrence": True} if wy else {}))  # fmt: skip
    grid = (ci.shape[0], 1, cu.numel() - 1) if varlen else ((T_ + 63) // 64, B_, B_)
    beta2 = beta.view(B_ * T_, HV_)
    flat = work.view(-1)
    if wy:
        t_beta, aqk = (flat[rows * 64 * i : rows * 64 * (i + 1)].view(B_ * T_, HV_, 64) for i in range(2))
        tail = flat[rows * 128 :].view(torch.float32).view(B_ * T_, HV_, ROW_FACTORS)
        calls.append(("intra", intra_kw, (
            q3, k3, v3, g.view(B_ * T_, HV_), beta2, a_log, bias, None, None, tail, None, aqk, t_beta, None, None,
            cu, ci, T_, grid[0], grid[1], scale, lb)))  # fmt: skip
        calls.append(("state", state_kw, (t_beta, v3, k3, q3, tail, aqk, o3, h0, ht, cu, T_, grid[2], scale)))
        return
    w, u, *gk = (flat[rows * 128 * i : rows * 128 * (i + 1)].view(B_ * T_, HV_, 128) for i in range(2 if rows_factors
                                                                                                  else 4))  # fmt: skip
    at = rows * 128 * (2 + len(gk))
    aqk = flat[at : at + rows * 64].view(B_ * T_, HV_, 64)
    tail = flat[at + rows * 64 :].view(torch.float32).view(B_ * T_, HV_, ROW_FACTORS if rows_factors else 128)
    if rows_factors:
        calls.append(("intra", intra_kw, (
            q3, k3, v3, g.view(B_ * T_, HV_), beta2, a_log, bias, w, u, tail, None, aqk, None, None, None, cu, ci, T_,
            grid[0], grid[1], scale, lb)))  # fmt: skip
        calls.append(("state", state_kw, (w, u, k3, q3, tail, aqk, o3, h0, ht, cu, T_, grid[2], scale)))
        return
    qg, kg = gk
    calls.append(("intra", intra_kw, (
        q3, k3, v3, g.view(B_ * T_, *g.shape[2:]), beta2, a_log, bias.view(HV_, K_), w, u, qg, kg, aqk, None, tail,
        None, cu, ci, T_, grid[0], grid[1], scale, lb)))  # fmt: skip
    calls.append(("state", state_kw, (w, u, kg, qg, tail, aqk, o3, h0, ht, cu, T_, grid[2], scale)))


def same_argument(a, b, inputs) -> None:
    """``a`` (the general path's) and ``b`` (the bound launch's) are the same argument: equal non-tensors; tensors of
    one shape, stride and dtype, the caller's own inputs (and small tensors) with the same storage or values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        if any(a.data_ptr() == t.data_ptr() for t in inputs) or a.numel() <= 8:
            assert a.data_ptr() == b.data_ptr() or torch.equal(a, b)
    else:
        assert a == b, (a, b)


def assert_same_calls(general: list, got: list, inputs: list) -> None:
    """The kernels ``got`` (a bound launch's recorded calls) are the ``general`` path's, with the same compile
    keywords and the same arguments (``same_argument``)."""
    assert [c[0] for c in general] == [c[0] for c in got]
    for (name, kw_g, args_g), (_, kw_p, args_p) in zip(general, got):
        assert kw_g == kw_p, name
        assert len(args_g) == len(args_p), name
        for a, b in zip(args_g, args_p):
            same_argument(a, b, inputs)
