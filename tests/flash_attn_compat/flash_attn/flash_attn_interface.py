"""``flash_attn.flash_attn_interface`` for flash-attn's own tests: fa_lab's interface, plus a test helper."""
from fa_lab.flash_attn.flash_attn_interface import *  # noqa: F403


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width flash-attn's CUDA kernel wrote its probability buffer in.

    flash-attn's tests use it only with dropout (``normalize_flash_attn_S``), to rescale the kernel's
    unnormalised, per-block probabilities.  fa_lab has no dropout: those tests raise
    NotImplementedError before they get here, and ``S_dmask`` is already normalised.  A valid block
    width is returned so that the file imports and the helper runs if called.
    """
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be 1..256, got {head_dim}")
    return 128 if head_dim <= 64 and not is_dropout else 64
