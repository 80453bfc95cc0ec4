"""flash-attn's ``flash_attn.layers``: here only ``rotary`` (rotary position embeddings)."""
