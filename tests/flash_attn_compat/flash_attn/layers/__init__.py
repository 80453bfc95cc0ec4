"""``flash_attn.layers`` for flash-attn's own tests."""
