"""Loss masks cover exactly the assistant tokens (plus the end-of-turn token), for two template styles."""

from __future__ import annotations

import pytest

from draftflow.data.chat import ChatEncoder, generation_stop_ids, load_chat_encoder
from draftflow.recipe.schema import TargetSection

CHATML_END = "<|im_end|>"


def masked_spans(tokenizer, encoded) -> list[str]:
    """Decoded runs of consecutive loss-masked tokens."""
    spans, current = [], []
    for token, keep in zip(encoded.input_ids, encoded.loss_mask):
        if keep:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(s) for s in spans]


def unmasked_text(tokenizer, encoded) -> str:
    return tokenizer.decode([t for t, m in zip(encoded.input_ids, encoded.loss_mask) if not m])


CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy? Answer in a list:\n- one\n- two"},
    {"role": "assistant", "content": "- Rome\n- (that is all)"},
]


def test_smollm2_mask_is_exactly_the_assistant_turns(smollm2_tokenizer):
    encoder = ChatEncoder(smollm2_tokenizer)
    encoded, reason = encoder.encode(CONVERSATION)
    assert reason is None
    assert masked_spans(smollm2_tokenizer, encoded) == [
        CONVERSATION[1]["content"] + CHATML_END,
        CONVERSATION[3]["content"] + CHATML_END,
    ]
    assert encoded.context_only_turns == 0 and encoded.retokenized_prompts == 0 and not encoded.truncated
    # The token sequence is the template's own tokenisation of the whole conversation.
    assert encoded.input_ids == smollm2_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=False
    )
    # Everything else, including the default system prompt and the newline after each
    # <|im_end|> (the model never generates it), is context.
    context = unmasked_text(smollm2_tokenizer, encoded)
    assert "You are a helpful AI assistant named SmolLM" in context
    assert context.count("<|im_start|>assistant\n") == 2


def test_smollm2_explicit_system_prompt(smollm2_tokenizer):
    conv = [{"role": "system", "content": "Answer in French."}] + CONVERSATION[:2]
    encoded, _ = ChatEncoder(smollm2_tokenizer).encode(conv)
    assert masked_spans(smollm2_tokenizer, encoded) == [conv[2]["content"] + CHATML_END]
    assert "SmolLM" not in smollm2_tokenizer.decode(encoded.input_ids)


def test_qwen3_style_template_history_turns_stay_context(smollm2_tokenizer, qwen3_like_template):
    conv = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd the numbers\n</think>\n\nIt is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6."},
    ]
    encoder = ChatEncoder(smollm2_tokenizer, chat_template=qwen3_like_template)
    encoded, reason = encoder.encode(conv)
    assert reason is None
    # The last turn renders with Qwen3's (here empty) think block, which the target emits itself
    # in thinking mode: masked from the end of the generation prompt to <|im_end|>.
    assert masked_spans(smollm2_tokenizer, encoded) == ["<think>\n\n</think>\n\nIt is 6." + CHATML_END]
    # The first turn's history form lost its reasoning, so it is not what the target emitted:
    # kept as context, counted.
    assert encoded.context_only_turns == 1
    full = smollm2_tokenizer.decode(encoded.input_ids)
    assert "It is 4." in full and "add the numbers" not in full
    assert full == encoder.render(conv)


def test_qwen3_style_non_thinking_mode_masks_only_the_answer(smollm2_tokenizer, qwen3_like_template):
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    encoder = ChatEncoder(smollm2_tokenizer, qwen3_like_template, template_kwargs={"enable_thinking": False})
    encoded, reason = encoder.encode(conv)
    assert reason is None
    # With thinking off the empty think block is part of the generation prompt (context).
    assert masked_spans(smollm2_tokenizer, encoded) == ["Hello!" + CHATML_END]
    # SmolLM2's GPT-2-style pre-tokeniser reads the prompt's final "\n\n" as one token alone but
    # as two once the reply follows: the reply tokens are exact, the context differs; counted.
    assert encoded.retokenized_prompts == 1


def test_qwen3_style_reasoning_in_last_turn_is_trained(smollm2_tokenizer, qwen3_like_template):
    answer = "<think>\nsmall greeting\n</think>\n\nHello!"
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
    encoded, _ = ChatEncoder(smollm2_tokenizer, qwen3_like_template).encode(conv)
    assert masked_spans(smollm2_tokenizer, encoded) == [answer + CHATML_END]
    assert encoded.context_only_turns == 0


def test_truncation_keeps_the_head_and_counts(smollm2_tokenizer):
    encoder = ChatEncoder(smollm2_tokenizer)
    whole, _ = encoder.encode(CONVERSATION)
    first_turn_end = whole.loss_mask.index(1) + 3
    cut, reason = encoder.encode(CONVERSATION, max_length=first_turn_end)
    assert reason is None and cut.truncated
    assert cut.input_ids == whole.input_ids[:first_turn_end]
    assert cut.loss_mask == whole.loss_mask[:first_turn_end]
    assert cut.num_loss_tokens == 3
    fits, _ = encoder.encode(CONVERSATION, max_length=len(whole.input_ids))
    assert not fits.truncated


def test_truncation_before_any_answer_drops(smollm2_tokenizer):
    encoder = ChatEncoder(smollm2_tokenizer)
    whole, _ = encoder.encode(CONVERSATION)
    assert encoder.encode(CONVERSATION, max_length=whole.loss_mask.index(1)) == (
        None,
        "no_loss_after_truncation",
    )


def test_control_tokens_in_content_are_refused(smollm2_tokenizer):
    conv = [{"role": "user", "content": "say <|im_end|> please"}, {"role": "assistant", "content": "no"}]
    assert ChatEncoder(smollm2_tokenizer).encode(conv) == (None, "control_token_in_content")


def test_template_errors_and_prefix_mismatch_are_reasons(smollm2_tokenizer):
    raising = "{{ raise_exception('roles must alternate') }}"
    conv = CONVERSATION[:2]
    assert ChatEncoder(smollm2_tokenizer, raising).encode(conv) == (None, "template_error")
    # A template whose header depends on the message count: the prompt the target would see
    # is not a prefix of the rendered conversation.
    counting = (
        "{{ 'turns: ' + (messages|length|string) + '\\n' }}{% for m in messages %}"
        "{{ m.role + ': ' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert ChatEncoder(smollm2_tokenizer, counting).encode(conv) == (None, "template_prefix_mismatch")
    # A prompt ending in a space: BPE merges it into the reply's first token (" The").
    spaced = (
        "{% for m in messages %}{{ m.role + ': ' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert ChatEncoder(smollm2_tokenizer, spaced).encode(conv) == (None, "token_boundary_mismatch")


def test_template_without_stop_token_masks_the_whole_turn(smollm2_tokenizer):
    plain = (
        "{% for m in messages %}{{ m.role + ':\\n' + m.content + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}"
    )
    conv = CONVERSATION[:2]
    encoded, reason = ChatEncoder(smollm2_tokenizer, plain).encode(conv)
    assert reason is None
    assert masked_spans(smollm2_tokenizer, encoded) == [conv[1]["content"] + "\n"]


def test_load_chat_encoder_from_target(smollm2_dir, tmp_path, qwen3_like_template):
    assert generation_stop_ids(str(smollm2_dir)) == [2]
    template = tmp_path / "qwen3_like.jinja"
    template.write_text(qwen3_like_template)
    encoder = load_chat_encoder(TargetSection(model=str(smollm2_dir), chat_template=str(template)))
    assert encoder.chat_template == qwen3_like_template
    assert encoder.stop_token_ids == {2}
    assert "<think>" in encoder.render(CONVERSATION[:2])


def test_tokenizer_without_template_is_an_error(smollm2_tokenizer):
    class NoTemplate:
        chat_template = None
        eos_token_id = 2
        is_fast = True

    with pytest.raises(ValueError, match="chat template"):
        ChatEncoder(NoTemplate())

    class Slow(NoTemplate):
        chat_template = "{{ messages }}"
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        ChatEncoder(Slow())
