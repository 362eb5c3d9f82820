"""`frontend.validation`: the prompt check both APIs make, every limit named in its error."""
from __future__ import annotations

import pytest

from tandem_serve.frontend.validation import Limits, ValidationError, check_prompt

LIMITS = Limits(max_model_len=64, max_new_tokens=32, default_max_new_tokens=20,
                vocab_size=1000, eos_token_ids=(2,), include_stop_sequence=True)


def test_prompt_length_limits() -> None:
    check_prompt(63, 0, LIMITS)
    check_prompt(60, 4, LIMITS)
    with pytest.raises(ValidationError, match="must not be empty"):
        check_prompt(0, 0, LIMITS)
    with pytest.raises(ValidationError, match="max model length 64"):
        check_prompt(64, 0, LIMITS, "request.text")
    with pytest.raises(ValidationError, match=r"min_new_tokens \(5\) exceeds the max model"):
        check_prompt(60, 5, LIMITS)
