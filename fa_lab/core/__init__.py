"""fa_lab/core"""
