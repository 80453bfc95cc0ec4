"""flash-attn 2.x's Python interface on fa_lab's kernels.

Swap ``import flash_attn`` for ``import fa_lab.flash_attn as flash_attn`` (and
``from flash_attn.bert_padding import ...`` for ``from fa_lab.flash_attn.bert_padding import ...``):
the same functions, argument names, defaults, layouts and return values as flash-attn 2.7.  What
differs is listed in ``fa_lab.flash_attn.flash_attn_interface``'s docstring.

=========================  ===================================================================
``flash_attn_interface``   the seven attention functions (flash-attn's names)
``bert_padding``           padded batches <-> packed tokens: ``unpad_input``, ``pad_input``, ...
``layers.rotary``          rotary embeddings, ``apply_rotary_emb`` (plain PyTorch)
``checks``                 input checks in flash-attn's layout
``engine``                 which kernel runs a call (Part I's FlashAttention-2, or the varlen one)
``kvcache``                ``flash_attn_with_kvcache``'s rotate, append and attend
``probs``                  the attention probabilities ``return_attn_probs`` returns
=========================  ===================================================================
"""
#: the flash-attn release whose interface this follows
__version__ = "2.7.4.post1"

from fa_lab.flash_attn.flash_attn_interface import (  # noqa: E402
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
