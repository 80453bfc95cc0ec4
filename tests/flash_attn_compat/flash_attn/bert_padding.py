"""``flash_attn.bert_padding`` for flash-attn's own tests: fa_lab's."""
from fa_lab.flash_attn.bert_padding import (  # noqa: F401
    IndexFirstAxis,
    IndexPutFirstAxis,
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
