"""Regeneration (`runtime.regenerate`) on the real template; the loop itself runs through
`eyas data prepare --regenerate` in tests/stages/test_data.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def real_tokenizer(builtin_target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_target)


def test_user_turn_opening_smollm2(real_tokenizer):
    """On the real template the sampled prompt starts right after the default system prompt and
    the user header, where a user's own text would."""
    from eyas.runtime.regenerate import user_turn_opening

    text = real_tokenizer.decode(user_turn_opening(real_tokenizer))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>user\n")
