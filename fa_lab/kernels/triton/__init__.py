"""fa_lab/kernels/triton"""
