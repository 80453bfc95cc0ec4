"""Kernels written in Gluon, Triton's lower-level language (chapter 11): ``fwd``, Hopper's warp-specialized forward."""
