"""``flash_attn`` for flash-attn's own tests: everything comes from ``fa_lab.flash_attn``."""
from fa_lab.flash_attn import *  # noqa: F403
from fa_lab.flash_attn import __all__, __version__  # noqa: F401
