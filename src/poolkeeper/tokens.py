"""The one approximate tokenizer shared by the simulator and the gateway.

A token is 4 characters of text (the rule of thumb GIE's prefix scorer also uses:
16 tokens x 4 chars = 64-char hash blocks). Exact counts would need the model's own tokenizer,
which neither a gateway nor a CPU-only simulator can afford on the hot path. What matters is that
both sides agree: the simulator bills prefill and KV blocks by these counts, and the gateway
estimates load and prefix hits with the same rule.

Chat messages are rendered into one prompt string with ChatML-style markers, so that the prompt
text (and hence prefix-cache blocks) of a conversation grows by appending as the chat continues.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CHARS_PER_TOKEN = 4


def count_tokens(text: str) -> int:
    """Tokens in `text`: ceil(len / 4); 0 for the empty string."""
    return -(-len(text) // CHARS_PER_TOKEN)


def message_text(content: Any) -> str:
    """The text of one chat message's `content`: a string, or a list of parts with `text`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def chat_prompt_text(messages: Iterable[Mapping[str, Any]]) -> str:
    """Render chat messages as `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message."""
    out: list[str] = []
    for message in messages:
        role = message.get("role", "user")
        out.append(f"<|im_start|>{role}\n{message_text(message.get('content'))}<|im_end|>\n")
    return "".join(out)


def count_chat_tokens(messages: Iterable[Mapping[str, Any]]) -> int:
    return count_tokens(chat_prompt_text(messages))
