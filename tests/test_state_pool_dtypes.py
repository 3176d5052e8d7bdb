"""bf16 / fp16 state pools in FLA 0.6.0's serving form (``fused_recurrent_kda_fwd``), on the CPU.

FLA's kernel reads a state as fp32, runs the recurrence in fp32 (the state carried in fp32 from token to token) and
stores each new state in the pool's dtype (``b_h.to(p_ht.dtype.element_ty)``: round to nearest even on the GPU); a
final state out of place is fp32. So a bf16 pool's call must give the outputs of the same call on the pool's values
in fp32 and the new rows of that call rounded to bf16, bit for bit, on cula's reference. Against FLA's own kernel,
run by Triton's CPU interpreter in a subprocess (which truncates an fp32 -> bf16 store where the GPU rounds to
nearest even): the same rows, within a unit in the last place of the pool's dtype.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cula.backends import clear_plan_caches
from cula.kda import fused_recurrent_kda, fused_recurrent_kda_fwd, kda_decode
from fla_interpreter import fla_interpreter_results

H, HV, D, P = 1, 2, 16, 7
HALF = (torch.bfloat16, torch.float16)
GATE = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def _tokens(N, T, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    return dict(q=rnd(N, T, H, D), k=rnd(N, T, H, D), v=rnd(N, T, HV, D), g=rnd(N, T, HV, D, dt=torch.float32),
                beta=rnd(N, T, HV, dt=torch.float32), A_log=rnd(HV, dt=torch.float32),
                dt_bias=rnd(HV * D, dt=torch.float32), **GATE)  # fmt: skip


def _pool(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(P, HV, D, D, generator=gen) * 0.5).to(dtype)


def _pair(x, dtype, **kw):
    """The call on a pool of ``dtype`` and on the same values in fp32: ``(o, ht, pool), (o32, ht32, pool32)``."""
    pool = _pool(dtype)
    pool32 = pool.to(torch.float32, copy=True)
    o, ht = fused_recurrent_kda_fwd(**x, initial_state=pool, **kw)
    o32, ht32 = fused_recurrent_kda_fwd(**x, initial_state=pool32, **kw)
    return (o, ht, pool), (o32, ht32, pool32)


def _untouched(pool, rows, dtype):
    """Whether the pool rows not in ``rows`` kept their values (the fresh pool's)."""
    others = [r for r in range(P) if r not in set(rows)]
    return torch.equal(pool[others], _pool(dtype)[others])


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_pool_in_place_rounds_each_new_state_once(dtype, state_v_first):
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    (o, ht, pool), (o32, _, pool32) = _pair(_tokens(3, 1), dtype, ssm_state_indices=idx, state_v_first=state_v_first)
    assert ht is pool and pool.dtype == dtype
    assert torch.equal(o, o32)  # the same fp32 recurrence on the same values
    assert torch.equal(pool, pool32.to(dtype))  # each new state rounded to nearest even, as FLA's store
    assert _untouched(pool, [4, 0, 2], dtype)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_pool_out_of_place_gives_fp32_states_and_leaves_the_pool(dtype):
    idx = torch.tensor([[4, 1], [0, 5], [2, 6]], dtype=torch.int32)
    acc = torch.tensor([1, 2, 2], dtype=torch.int32)  # rows read: 4, 5, 6
    kw = dict(ssm_state_indices=idx, num_accepted_tokens=acc, inplace_final_state=False, output_final_state=True)
    (o, ht, pool), (o32, ht32, _) = _pair(_tokens(3, 1), dtype, **kw)
    assert ht.dtype == torch.float32 and ht.shape == (3, HV, D, D)
    assert torch.equal(o, o32) and torch.equal(ht, ht32)
    assert torch.equal(pool, _pool(dtype))  # only read
    # the states FLA's public form gives from the rows read, as fp32 initial states
    o_ref, ht_ref = fused_recurrent_kda(**_tokens(3, 1), initial_state=_pool(dtype)[[4, 5, 6]].float(),
                                        output_final_state=True)  # fmt: skip
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["fp32", "bf16", "fp16"])
def test_per_token_rows_carry_the_state_in_fp32(dtype):
    """[N, T'] indices: each token's state stored at its row, rounded once; the next token goes on from the fp32
    state, not from the rounded row (else the later rows would differ from the fp32 pool's rounded), and with
    ``num_accepted_tokens`` the state is read from the last accepted token's row."""
    x = _tokens(3, 3, seed=2)
    idx = torch.tensor([[1, 3, 5], [0, 6, 2], [4, 4, 4]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)  # rows read: 3, 0, 4
    (o, _, pool), (o32, _, pool32) = _pair(x, dtype, ssm_state_indices=idx, num_accepted_tokens=acc)
    assert torch.equal(o, o32) and torch.equal(pool, pool32.to(dtype))
    assert _untouched(pool, idx.reshape(-1).tolist(), dtype)
    # the same tokens one call each, every token reading the row the one before it wrote ([N, 2] indices: written
    # at column 0, read at column 1): the fp32 pool's numbers again, but a half pool's state is then rounded
    # between tokens, which FLA's kernel does not do within a call
    step, read = _pool(dtype), idx[torch.arange(3), acc.long() - 1]
    for t in range(3):
        rows = torch.stack([idx[:, t], read], 1)
        tokens = {n: (v[:, t : t + 1] if n in ("q", "k", "v", "g", "beta") else v) for n, v in x.items()}
        fused_recurrent_kda_fwd(**tokens, initial_state=step, ssm_state_indices=rows,
                                num_accepted_tokens=torch.full((3,), 2, dtype=torch.int32))  # fmt: skip
        read = idx[:, t]
    if dtype == torch.float32:
        assert torch.equal(step, pool)
    else:
        assert not torch.equal(step[[5, 2, 4]], pool[[5, 2, 4]])


def test_packed_pool_with_an_empty_sequence():
    """``cu_seqlens`` with an empty sequence: nothing read or written for it; out of place, FLA's kernel writes a
    sequence's state at its first token's position (``bos``), so the final state's rows follow the tokens."""
    x = _tokens(1, 2, seed=3)
    cu = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    idx = torch.tensor([5, 3, 1], dtype=torch.int32)
    (o, _, pool), (o32, _, pool32) = _pair(x, torch.bfloat16, cu_seqlens=cu, ssm_state_indices=idx)
    assert torch.equal(o, o32) and torch.equal(pool, pool32.to(torch.bfloat16))
    assert _untouched(pool, [5, 1], torch.bfloat16)  # row 3 (the empty sequence's) too
    kw = dict(cu_seqlens=cu, ssm_state_indices=idx, inplace_final_state=False, output_final_state=True)
    o2, ht = fused_recurrent_kda_fwd(**x, initial_state=_pool(torch.bfloat16), **kw)
    assert torch.equal(o2, o) and ht.dtype == torch.float32 and ht.shape[0] == 3
    assert torch.equal(ht[:2].to(torch.bfloat16), pool[[5, 1]])  # sequence 0 at row 0, sequence 2 at row 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_negative_indices_are_padded_slots(dtype):
    """FLA's kernel would follow a negative index out of the pool; cula's reference takes it as a padded slot, as
    cula's decode kernel does: read there, the sequence is skipped (zero outputs, nothing stored); written there,
    that token's state is not stored (the later tokens' are)."""
    x = _tokens(3, 2, seed=4)
    idx = torch.tensor([[2, -1], [-1, 4], [6, 1]], dtype=torch.int32)
    (o, _, pool), (o32, _, pool32) = _pair(x, dtype, ssm_state_indices=idx)
    assert torch.equal(o, o32) and torch.equal(pool, pool32.to(dtype))
    assert torch.equal(o[1], torch.zeros_like(o[1]))  # read at -1: skipped, its row 4 untouched
    assert _untouched(pool, [2, 6, 1], dtype)
    # sequence 0's first token is stored at row 2, sequence 2's at 6 and 1, as an unpadded call stores them
    (o_b, _, pool_b), _ = _pair(x, dtype, ssm_state_indices=torch.tensor([[2, 3], [0, 0], [6, 1]], dtype=torch.int32))
    assert torch.equal(pool[[2, 6, 1]], pool_b[[2, 6, 1]]) and torch.equal(o[[0, 2]], o_b[[0, 2]])


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_own_state_in_place_is_stored_in_its_dtype(dtype):
    """No indices, ``inplace_final_state=True``: the caller's ``[N, ...]`` state updated in place, in its dtype."""
    x = _tokens(2, 3, seed=5)
    state = _pool(dtype)[:2].clone()
    o, ht = fused_recurrent_kda_fwd(**x, initial_state=state)
    o32, ht32 = fused_recurrent_kda(**x, initial_state=_pool(dtype)[:2].float(), output_final_state=True)
    assert ht is state and state.dtype == dtype
    assert torch.equal(o, o32) and torch.equal(state, ht32.to(dtype))


def test_public_form_takes_a_half_pool_through_its_serving_keywords():
    x = _tokens(3, 1, seed=6)
    idx = torch.tensor([1, 2, 3], dtype=torch.int32)
    pool, pool_b = _pool(torch.bfloat16), _pool(torch.bfloat16)
    o, ht = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    o_b, _ = fused_recurrent_kda_fwd(**x, initial_state=pool_b, ssm_state_indices=idx)
    assert ht is pool and torch.equal(o, o_b) and torch.equal(pool, pool_b)


def test_what_is_still_refused():
    x = _tokens(3, 1)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="initial_state"):  # FLA's kernel would, but cula takes no float64 pool
        fused_recurrent_kda_fwd(**x, initial_state=_pool(torch.float64), ssm_state_indices=idx)
    with pytest.raises(ValueError, match="ssm_state_indices"):  # read on the host by the reference
        fused_recurrent_kda_fwd(**x, initial_state=_pool(torch.bfloat16), ssm_state_indices=idx + P)
    with pytest.raises(ValueError, match="num_accepted_tokens"):  # FLA's kernel would read another sequence's row
        fused_recurrent_kda_fwd(**x, initial_state=_pool(torch.bfloat16), ssm_state_indices=idx[:, None].contiguous(),
                                num_accepted_tokens=torch.tensor([1, 2, 1], dtype=torch.int32))  # fmt: skip
    pool = _pool(torch.bfloat16)
    with pytest.raises(TypeError, match="state_pool"):  # cula's own decode API: fp32 pools, as documented
        kda_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx, A_log=x["A_log"], dt_bias=x["dt_bias"],
                   state_v_first=False)  # fmt: skip
    assert torch.equal(pool, _pool(torch.bfloat16))


def test_half_pools_go_to_fla_on_cuda_with_the_reason_logged(pretend_sm90, caplog):
    """cula's decode kernel takes fp32 pools: its backend declines a bf16 / fp16 pool with a reason that the registry
    logs, and FLA's kernel (which takes the pool) runs the call; kda_decode's backend declines one too."""
    from cula.kda.backends import fused_recurrent_kda_registry
    from cula.kda.decode import kda_decode_registry

    caplog.set_level(logging.INFO, logger="cula")
    clear_plan_caches()
    x = _tokens(3, 1, seed=7)
    x["q"], x["k"], x["v"] = (torch.randn(3, 1, h, 64).to(torch.bfloat16) for h in (H, H, HV))
    x["g"], x["dt_bias"] = torch.randn(3, 1, HV, 64), torch.randn(HV * 64)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    for dtype in HALF:
        args = dict(x, initial_state=torch.zeros(P, HV, 64, 64, dtype=dtype), scale=0.125, output_final_state=False,
                    inplace_final_state=True, state_v_first=False, cu_seqlens=None, ssm_state_indices=idx,
                    num_accepted_tokens=None, allow_neg_eigval=False, lower_bound=None, out=None)  # fmt: skip
        ok, why = fused_recurrent_kda_registry.verdict("cula-sm90", x["q"].device, args)
        assert not ok and f"{dtype} state pool" in why, why
        assert fused_recurrent_kda_registry.select(x["q"].device, args).name == "fla"
        assert f"kda.fused_recurrent_kda -> fla (cula-sm90: a {dtype} state pool" in caplog.text
        decode_args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], state_pool=args["initial_state"],
                           state_v_first=False)  # fmt: skip
        ok, why = kda_decode_registry.verdict("cula-sm90", x["q"].device, decode_args)
        assert not ok and "state_pool dtype" in why, why
    # Gated DeltaNet's recurrent form reads a half initial_state as fp32 before its decode verifier sees it; the
    # verifier itself declines a state that is not fp32
    from cula.gated_delta_rule.backends import fused_recurrent_gdn_registry

    gdn = dict(q=x["q"], k=x["k"], v=x["v"], g=torch.randn(3, 1, HV), gk=None, gv=None, beta=x["beta"],
               initial_state=torch.zeros(3, HV, 64, 64, dtype=torch.bfloat16), state_v_first=False, cu_seqlens=None,
               A_log=None, dt_bias=None)  # fmt: skip
    ok, why = fused_recurrent_gdn_registry.verdict("cula-sm90", x["q"].device, gdn)
    assert not ok and "fp32 initial_state" in why, why
    clear_plan_caches()


CASES = ("indices [N]", "indices [N, T'] + accepted", "packed, an empty sequence", "out of place", "v-first")


def _case(name: str, dtype: torch.dtype) -> tuple[dict, list[int]]:
    """One serving call of FLA's form on a fresh pool of ``dtype``, and the pool rows it writes."""
    i32 = dict(dtype=torch.int32)
    if name == "indices [N]":
        call = dict(_tokens(3, 1), ssm_state_indices=torch.tensor([4, 0, 2], **i32))
        return dict(call, initial_state=_pool(dtype)), [4, 0, 2]
    if name == "indices [N, T'] + accepted":
        call = dict(_tokens(3, 3, seed=2), ssm_state_indices=torch.tensor([[1, 3, 5], [0, 6, 2], [4, 4, 4]], **i32),
                    num_accepted_tokens=torch.tensor([2, 1, 3], **i32))  # fmt: skip
        return dict(call, initial_state=_pool(dtype)), [1, 3, 5, 0, 6, 2, 4]
    if name == "packed, an empty sequence":
        call = dict(_tokens(1, 2, seed=3), cu_seqlens=torch.tensor([0, 1, 1, 2], **i32),
                    ssm_state_indices=torch.tensor([5, 3, 1], **i32))  # fmt: skip
        return dict(call, initial_state=_pool(dtype)), [5, 1]
    if name == "out of place":
        call = dict(_tokens(3, 1, seed=4), ssm_state_indices=torch.tensor([[4, 1], [0, 5], [2, 6]], **i32),
                    num_accepted_tokens=torch.tensor([1, 2, 2], **i32), inplace_final_state=False,
                    output_final_state=True)  # fmt: skip
        return dict(call, initial_state=_pool(dtype)), []
    call = dict(_tokens(3, 2, seed=5), ssm_state_indices=torch.tensor([[6, 2], [1, 4], [3, 0]], **i32),
                state_v_first=True)  # fmt: skip
    return dict(call, initial_state=_pool(dtype)), [6, 2, 1, 4, 3, 0]


def _compare_with_fla() -> dict:
    """Run in the interpreter's subprocess: each case on FLA's kernel and on cula's reference backend."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd

    results = {}
    for name in CASES:
        for dtype in (torch.float32, *HALF):
            runs = []
            for fn in (fla_fwd, fused_recurrent_kda_fwd):
                call, rows = _case(name, dtype)
                pool = call["initial_state"]
                o, ht = fn(**call)
                runs.append((o.float(), ht, pool))
            (o_f, ht_f, pool_f), (o_c, ht_c, pool_c) = runs
            state_f, state_c = (ht_f, ht_c) if name == "out of place" else (pool_f, pool_c)
            others = [r for r in range(P) if r not in rows]
            results[f"{name}: {dtype}"] = {
                "o": ((o_f - o_c).abs() / o_c.abs().clamp(min=1e-2)).max().item(),  # o is bf16
                # FLA's rounding against the reference's, relative to each value (a unit in the last place of
                # the dtype: 2^-7 bf16, 2^-10 fp16)
                "state": ((state_f.float() - state_c.float()).abs() / state_c.float().abs().clamp(min=1e-2))
                .max().item(),
                "final": [str(ht_f.dtype), str(ht_c.dtype), ht_f is pool_f, ht_c is pool_c],
                "untouched": torch.equal(pool_f[others], pool_c[others]) and torch.equal(pool_c[others],
                                                                                         _pool(dtype)[others]),
            }
    return results


def test_flas_kernel_under_the_interpreter_agrees():
    """FLA 0.6.0's own Triton kernel (Triton's CPU interpreter) and cula's reference on the same serving calls with
    fp32, bf16 and fp16 pools: outputs to fp32 rounding, new states within fp32 rounding (fp32) or one unit in the
    last place of the pool's dtype (the interpreter truncates an fp32 -> bf16 store, the GPU rounds to nearest even),
    the rows no sequence writes untouched, ``final_state`` the pool itself in place and an fp32 tensor of its own out
    of place, for both."""
    pytest.importorskip("fla")
    results = fla_interpreter_results("test_state_pool_dtypes")
    assert len(results) == 3 * len(CASES)
    ulp = {"torch.float32": 1e-5, "torch.bfloat16": 2.0**-7, "torch.float16": 2.0**-10}
    for key, r in results.items():
        dtype = key.rsplit(": ", 1)[1]
        assert r["o"] <= 2.0**-7 * 1.01, (key, r)
        assert r["state"] <= ulp[dtype] * 1.01, (key, r)
        assert r["untouched"], (key, r)
        if key.startswith("out of place"):
            assert r["final"] == ["torch.float32", "torch.float32", False, False], (key, r)
        else:
            assert r["final"] == [dtype, dtype, True, True], (key, r)
