"""flash-attn 2.x's interface under the module name flash-attn's documentation uses.

``from fa_lab.flash_attn_interface import flash_attn_func`` is
``from fa_lab.flash_attn.flash_attn_interface import flash_attn_func``: one implementation, two names.
"""
from fa_lab.flash_attn.flash_attn_interface import *  # noqa: F403  (its __all__: the seven functions)
from fa_lab.flash_attn.flash_attn_interface import __all__  # noqa: F401
