"""Long inputs on the GPU: indices past 2^31 elements, and Lightning over 128K tokens with strong and zero decay,
each against the float64 reference.

Issue 3 asks for T up to 1M tokens without overflow, issue 5 for T = 128K with strong and zero decay. These are
the sizes where an int32 offset or an fp32 decay product would break while every small test passes. Each test
allocates tens of GB (the H200 has 141), so they run one at a time and free what they made.
"""

import gc
import os

import pytest
import torch

from cula.testing import assert_close

pytestmark = pytest.mark.gpu
os.environ.setdefault("FLA_FLASH_KDA", "0")
DEV = "cuda"
TOL = 5e-3


@pytest.fixture(autouse=True)
def _free_after():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _needs_gib(gib: float):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    free, _total = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2**30:.0f} free")


@pytest.mark.parametrize("intra,segments", [("auto", True), ("1", False)])
def test_chunk_kda_past_int32_offsets(intra, segments, monkeypatch, kda_tuning):
    """B=1, T=2^20, H=HV=16, K=V=128: T*HV*K = 2^31 elements, so every flat offset past the middle needs 64 bits.
    ``segments``: the bound launch in time segments (two kernel calls a segment), or in one host call for both
    kernels (``fwd_launch``, whose workspace regions then start past 2^31 elements too)."""
    import fla.ops.kda as fk

    import cula.kda as ck
    from cula.backends import clear_plan_caches

    _needs_gib(90)
    monkeypatch.setenv("CULA_KDA_INTRA", intra)  # "1": cula's intra kernel too, not only the state/output one
    if not segments:
        kda_tuning(overlap_state_min_tokens=None)
    clear_plan_caches()
    T, H, D = 2**20, 16, 128
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(1, T, H, device=DEV, dtype=torch.bfloat16)
    A_log = torch.randn(H, device=DEV) * 0.5
    dt_bias = torch.randn(H * D, device=DEV) * 0.5
    h0 = torch.randn(1, H, D, D, device=DEV) * 0.1
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, state_v_first=True, A_log=A_log,
              dt_bias=dt_bias)  # fmt: skip
    with torch.inference_mode():
        o, ht = ck.chunk_kda(q, k, v, g, beta, **kw)
        torch.cuda.synchronize()
        o_f, ht_f = fk.chunk_kda(q, k, v, g, beta, **kw)
    assert_close("final state", ht_f, ht, TOL)
    # the whole output, and its last chunk alone (the rows with the largest offsets)
    assert_close("o", o_f, o, TOL)
    assert_close("o, last 64 tokens", o_f[:, -64:], o[:, -64:], TOL)

    # The float64 reference on windows of W tokens (the whole 2^20 would not fit beside the test's 90 GB): the
    # first W from h0, and the last W after W tokens of warm-up from a zero state. The warm-up stands for the
    # whole prefix because the state forgets it: a key channel loses 5 sigmoid(exp(A_log) (g + dt_bias)) nats a
    # step, on average a tenth of a nat or more even where A_log and dt_bias are 3 sigma from their means, so W
    # steps scale what came before by less than e^-100; the delta rule's (I - beta k k^T), |k| = 1, never grows it.
    from cula.kda.naive import reference_chunk_kda

    W = 1024
    flags = {n: x for n, x in kw.items() if n != "initial_state"}

    def reference(span, h):
        with torch.inference_mode():
            return reference_chunk_kda(*(x[:, span].double() for x in (q, k, v, g, beta)), initial_state=h,
                                       compute_dtype=torch.float64, **flags)  # fmt: skip

    head, _ = reference(slice(0, W), h0.double())
    tail, tail_state = reference(slice(T - 2 * W, T), None)
    for who, (o_x, ht_x) in (("cula", (o, ht)), ("fla", (o_f, ht_f))):
        assert_close(f"{who} o, first {W} tokens vs ref", head, o_x[:, :W], TOL)
        assert_close(f"{who} o, last {W} tokens vs ref", tail[:, W:], o_x[:, -W:], TOL)
        assert_close(f"{who} final state vs ref", tail_state, ht_x, TOL)


@pytest.mark.parametrize("decay_kind", ["zero", "strong"])
def test_lightning_128k_tokens(decay_kind):
    """T = 131072 with zero decay (the state only grows) and strong decay (up to 8 nats per step), vs float64."""
    from cula.lightning import lightning_attn_fwd
    from cula.simple_gla.naive import reference_chunk_simple_gla

    _needs_gib(40)
    B, T, H, D = 1, 2**17, 8, 128
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, T, H, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    if decay_kind == "zero":
        decay = torch.zeros(H, device=DEV)
    else:
        decay = torch.linspace(0.0, 8.0, H, device=DEV)
    h0 = torch.randn(B, H, D, D, device=DEV) * 0.1
    with torch.inference_mode():
        o, ht = lightning_attn_fwd(q, k, v, decay, initial_state=h0, output_final_state=True)
        torch.cuda.synchronize()
        ro, rt = reference_chunk_simple_gla(q.double(), k.double(), v.double(), g_gamma=-decay.double(),
                                            initial_state=h0.double(), output_final_state=True)  # fmt: skip
    assert_close("o", ro, o, TOL)
    assert_close("final state", rt, ht, TOL)
    assert_close("o, last 64 tokens", ro[:, -64:], o[:, -64:], TOL)
