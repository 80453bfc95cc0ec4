"""``flash_attn.layers.rotary`` for flash-attn's own tests: fa_lab's plain-PyTorch rotary embeddings."""
from fa_lab.flash_attn.layers.rotary import (  # noqa: F401
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
    rotate_half,
)
