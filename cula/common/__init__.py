"""Stages that FLA's ops share (``fla.ops.common``): ``chunk_o.chunk_bwd_dqkwg``, the gated dq / dk / dw / dg stage
FLA 0.6.0 refuses on Hopper with the Triton PyTorch ships."""
