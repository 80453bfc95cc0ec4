"""fa_lab/kernels/numba"""
