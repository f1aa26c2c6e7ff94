"""Text generation with a KV cache: greedy, or temperature and top-p (nucleus) sampling.

The prompt runs through the model once, filling one KVCache per layer; then each new token
is one forward pass of a single position over the cached keys and values, so a token costs
one position's compute instead of the whole sequence's. Single device, no parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token from one position's logits [vocab]: the argmax when temperature is 0,
    else a sample from softmax(logits / temperature) cut to the smallest set of tokens whose
    probability reaches top_p."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the tokens ranked above
        sorted_probs[before >= top_p] = 0.0  # the token that crosses top_p stays in
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@torch.no_grad()
def generate(model: Any, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: int | None = None, seed: int = 0,
             on_token: Callable[[int], None] | None = None) -> list[int]:
    """The tokens that follow `prompt` (at most `max_new_tokens`, ending at `eos_id` if it
    comes, which is included); `on_token` sees each as it is chosen (streaming). `model` is
    a language model with `new_caches` and `forward(tokens, caches)` (Transformer, GptOss)."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}: expected a probability in (0, 1]")
    device = model.tok_embeddings.weight.device
    room = model.args.max_seq_len - len(prompt)
    if room <= 0:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model's context is {model.args.max_seq_len}")
    max_new_tokens = min(max_new_tokens, room)
    generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
    caches = model.new_caches(1, len(prompt) + max_new_tokens)
    logits = model(torch.tensor([prompt], device=device), caches)[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = pick(logits, temperature, top_p, generator)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token == eos_id or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[token]], device=device), caches)[0, -1]
    return out
