"""Prompt formats: a plain prompt is the body then the answer prefix, behind the tokenizer's
default BOS; a chat prompt opens the answer in the assistant turn; character offsets map to
the first token that reaches past them; chat without a template is refused."""

from __future__ import annotations

import pytest

from ropekit.evals.prompts import PromptFormat, default_prefix


def test_a_plain_prompt_is_the_body_then_the_answer_prefix(byte_tok):
    fmt = PromptFormat(byte_tok)
    assert fmt.name == "plain" and fmt.prefix == ()  # bytes: no BOS
    assert fmt.render("The key is 7.", "The key:") == ("The key is 7. The key:", 0)
    assert fmt.render("Just text.", "") == ("Just text.", 0)
    assert fmt.encode("hé") == list("hé".encode())


def test_offsets_map_to_the_first_token_past_them_behind_the_prefix(byte_tok, bpe_tok):
    text = "añb needle"  # ñ is two bytes: offsets count characters, tokens bytes
    assert PromptFormat(byte_tok).locate(text, [0, 2, 4]) == (11, [0, 3, 5])
    fmt = PromptFormat(bpe_tok)
    assert fmt.prefix == default_prefix(bpe_tok) == (bpe_tok.tokenizer.bos_token_id,)
    n, (start,) = fmt.locate(text, [0])
    assert n == len(fmt.encode(text)) and start == 1  # the text starts after BOS
    assert fmt.encode(text)[0] == bpe_tok.tokenizer.bos_token_id


def test_a_chat_prompt_opens_the_answer_in_the_assistant_turn(bpe_tok):
    fmt = PromptFormat(bpe_tok, chat=True)
    assert fmt.name == "chat" and fmt.prefix == ()  # the template writes its own
    text, offset = fmt.render("Where is it?", "It is")
    assert text[offset:].startswith("Where is it?") and text.endswith("It is")


def test_chat_without_a_template_is_refused(byte_tok):
    with pytest.raises(ValueError, match="chat=True is not allowed with tokenizer"):
        PromptFormat(byte_tok, chat=True)
