"""fa_lab/kernels"""
