"""flash-attn 2.x's interface under the module name flash-attn's documentation uses.

``from fa_lab.flash_attn_interface import flash_attn_func`` is
``from fa_lab.flash_attn.flash_attn_interface import flash_attn_func``: one implementation, two names.
"""
from fa_lab.flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]
