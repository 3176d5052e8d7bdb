"""``cula.testing.check_launch``: a launch's arguments against a variant's compiled signature, on the CPU (the check
``tests/test_variants.py`` runs on every launch its calls make)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")


def _signature():
    """A signature in the kernels' style: two token tensors sharing the token and head symbols, an optional input,
    a 64-bit stride divisible by 128, an Int32 and a Float32 scalar, the environment's stream."""
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    tt, h = cute.sym_int32(), cute.sym_int32()

    def tok(dt):
        return make_fake_tensor(dt, (tt, h, 128), (cute.sym_int64(divisibility=128), 128, 1), assumed_align=16)

    return (tok(BFloat16), tok(Float32), None, Int32(1), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))


def _args(T=10, H=2):
    return [torch.zeros(T, H, 128, dtype=torch.bfloat16), torch.zeros(T, H, 128), None, T, 0.5]


def test_a_matching_launch_passes():
    from cula.testing import check_launch

    check_launch(_signature(), tuple(_args()))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__(1, torch.zeros(11, 2, 128)), r"#1 shape\[0\] is 11, but argument #0 shape\[0\] is 10"),
        (lambda a: a.__setitem__(1, torch.zeros(10, 2, 128, dtype=torch.bfloat16)), "#1 is torch.bfloat16"),
        (lambda a: a.__setitem__(0, torch.zeros(10, 2, 64, dtype=torch.bfloat16)), r"shape\[2\] is 64"),
        (lambda a: a.__setitem__(1, torch.zeros(10, 2, 256)[..., :128]), r"stride\[1\] is 256"),
        (lambda a: a.__setitem__(2, torch.zeros(1)), "#2 is Tensor, the signature has NoneType"),
        (lambda a: a.__setitem__(3, 2**31), "past Int32's range"),
        (lambda a: a.__setitem__(3, 1.0), "must be an int"),
        (lambda a: a.__setitem__(4, torch.tensor(0.5)), "must be a Python number"),
        (lambda a: a.pop(), "4 arguments launched, the signature has 5"),
        (lambda a: a.__setitem__(0, torch.zeros(10 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(10, 2, 128)),
         "not 16-byte aligned"),
    ],
    ids=["symbol-bound-twice", "dtype", "static-size", "static-stride", "optional", "int32-range", "int-scalar",
         "number-scalar", "count", "alignment"],
)  # fmt: skip
def test_a_mismatch_names_the_argument(change, message):
    from cula.testing import check_launch

    args = _args()
    change(args)
    with pytest.raises(AssertionError, match=message):
        check_launch(_signature(), tuple(args), "k")
