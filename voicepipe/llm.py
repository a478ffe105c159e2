"""What an LLM is asked: :class:`LLMRequest` (a base layer: the hardware models and the backends both take it).

A request is its token counts (all a modelled backend needs) and, for a backend that runs a real model, the
conversation itself. :mod:`voicepipe.backends.base` re-exports it beside the backend interface.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LLMRequest:
    session: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int = 0  # prefix-cache hits skip prefill for these
    # the conversation as (role, content) pairs, for backends that run a real model (endpoints); the
    # modelled backends only need the token counts above
    messages: tuple[tuple[str, str], ...] = ()
