"""How a task's text becomes the model's input: plain text, or an instruction model's chat
template.

Holds:
- `PromptFormat`: renders (body, answer prefix) into the prompt text, encodes it, and maps
  character offsets to token positions.
- `default_prefix(tokenizer)`: the ids a tokenizer puts before a text by default (BOS).

Plain prompts are `body + " " + answer_prefix`: a base model continues the answer sentence.
Chat prompts put the body in a user turn and start the assistant turn with the answer prefix
(as RULER does), so an instruction model also answers in the expected shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ropekit.data.tokenizers import HFTokenizer, Tokenizer


def default_prefix(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids the tokenizer adds in front of a text by default (Llama's BOS); () for bytes.

    ropekit's tokenizers encode without special tokens, but a Llama-family model reads every
    document after a BOS during training and behaves oddly without one.
    """
    if not isinstance(tokenizer, HFTokenizer):
        return ()
    hf = tokenizer.tokenizer
    plain = hf("a", add_special_tokens=False)["input_ids"]
    special = hf("a", add_special_tokens=True)["input_ids"]
    # The text's own ids sit somewhere in `special`; whatever precedes them is the prefix
    # (an appended EOS, as some tokenizers add, is not wanted before a prompt's answer).
    for start in range(len(special) - len(plain) + 1):
        if special[start : start + len(plain)] == plain:
            return tuple(int(i) for i in special[:start])
    return ()


@dataclass(frozen=True, eq=False)
class PromptFormat:
    """Prompt rendering and encoding for one tokenizer.

    `chat=True` needs a Hugging Face tokenizer with a chat template. `prefix` (derived) is
    prepended to plain prompts: the tokenizer's default BOS. Chat templates write their own.
    """

    tokenizer: Tokenizer
    chat: bool = False
    prefix: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.chat:
            template = getattr(getattr(self.tokenizer, "tokenizer", None), "chat_template", None)
            if not isinstance(self.tokenizer, HFTokenizer) or not template:
                raise ValueError(
                    f"chat=True is not allowed with tokenizer {self.tokenizer.name!r}: it has no "
                    "chat template; allowed: chat=False, or an instruction model's tokenizer"
                )
        object.__setattr__(self, "prefix", () if self.chat else default_prefix(self.tokenizer))

    @property
    def name(self) -> str:
        return "chat" if self.chat else "plain"

    def render(self, body: str, answer_prefix: str) -> tuple[str, int]:
        """The prompt text and the character offset where `body` starts in it."""
        if not self.chat:
            return (f"{body} {answer_prefix}" if answer_prefix else body), 0
        hf = self.tokenizer.tokenizer  # type: ignore[attr-defined]
        rendered = hf.apply_chat_template(
            [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
        )
        offset = rendered.find(body)
        if offset < 0:
            raise ValueError(
                f"the chat template of {self.tokenizer.name!r} rewrites the user message, so "
                "needle positions cannot be located; allowed: chat=False"
            )
        return rendered + answer_prefix, offset

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (prefix included)."""
        return [*self.prefix, *self.tokenizer.encode(text)]

    def locate(self, text: str, chars: list[int]) -> tuple[int, list[int]]:
        """Encode `text` once; return its token count and the token index at each character
        offset in `chars` (the first token that reaches past that character)."""
        ids, nbytes = self.tokenizer.encode_with_bytes(text)
        byte_ends = np.cumsum(nbytes)
        positions = []
        for char in chars:
            byte = len(text[:char].encode("utf-8"))
            positions.append(len(self.prefix) + int(np.searchsorted(byte_ends, byte, "right")))
        return len(self.prefix) + len(ids), positions
