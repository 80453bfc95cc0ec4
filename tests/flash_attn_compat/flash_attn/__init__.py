"""``flash_attn`` for flash-attn's own tests: everything comes from ``fa_lab.flash_attn``."""
from fa_lab.flash_attn import (  # noqa: F401
    __version__,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
