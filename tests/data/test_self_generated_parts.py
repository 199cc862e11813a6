"""Self-generated data without a server: template prefixes, steering, fingerprint, partial file."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from draftflow.data.chat import ChatEncoder
from draftflow.data.self_generated import (
    TOPIC_SEEDS,
    NoUserRole,
    _Partial,
    check_user_role,
    steering,
    user_turn_prefix,
)
from draftflow.extraction.run import generation_dtype
from draftflow.paths import DataLayout
from draftflow.recipe import fingerprint
from draftflow.recipe.fingerprint import fingerprint_inputs
from draftflow.recipe.load import RecipeError, recipe_from_dict
from draftflow.recipe.schema import SelfGeneratedSection, Topic

QUALITY = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-dflash-cpu-quality.yaml"


def test_user_turn_prefix_stops_where_the_user_message_starts(smollm2_tokenizer):
    encoder = ChatEncoder(smollm2_tokenizer)
    plain = user_turn_prefix(encoder, [])
    assert plain.endswith("<|im_start|>user\n") and "SmolLM" in plain  # the template's default system prompt
    steered = user_turn_prefix(encoder, [{"role": "system", "content": "Ask about maths."}])
    assert steered == "<|im_start|>system\nAsk about maths.<|im_end|>\n<|im_start|>user\n"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    follow = user_turn_prefix(encoder, history)
    assert follow == encoder.render(history) + "<|im_start|>user\n"


def test_template_without_user_role_is_refused(smollm2_tokenizer):
    no_user = "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(NoUserRole, match="no user role"):
        check_user_role(ChatEncoder(smollm2_tokenizer, no_user))
    raising = "{% for m in messages %}{% if m.role == 'user' %}{{ raise_exception('no users') }}{% endif %}{% endfor %}"
    with pytest.raises(NoUserRole, match="no users"):
        check_user_role(ChatEncoder(smollm2_tokenizer, raising))


def test_every_topic_has_a_seed_instruction_and_topics_rotate():
    assert set(TOPIC_SEEDS) == set(Topic.__args__)
    settings = SelfGeneratedSection(topics=["coding", "math"], system_prompt="Be curious.")
    assert steering(settings, 0) == "Be curious. " + TOPIC_SEEDS["coding"]
    assert steering(settings, 3) == "Be curious. " + TOPIC_SEEDS["math"]
    assert steering(SelfGeneratedSection(), 5) is None


def test_fingerprint_follows_generation_settings_and_seed_not_concurrency():
    data = yaml.safe_load(QUALITY.read_text())
    base = fingerprint(recipe_from_dict(data), [2, 15, 27, 30])

    def changed(edit) -> str:
        d = copy.deepcopy(data)
        edit(d)
        return fingerprint(recipe_from_dict(d), [2, 15, 27, 30])

    generation = lambda d: d["data"]["sources"][0]["self_generated"]  # noqa: E731
    assert changed(lambda d: d["data"].update(regenerate_concurrency=64)) == base
    assert changed(lambda d: d["data"].update(seed=1)) != base
    assert changed(lambda d: generation(d).update(temperature=0.7)) != base
    assert changed(lambda d: generation(d).update(topics=["coding"])) != base
    assert changed(lambda d: generation(d).update(num_prompts=10)) != base
    assert changed(lambda d: d["data"].update(generation_dtype="float16")) != base


def test_generation_dtype_defaults_to_the_extraction_servers_and_unset_keeps_old_fingerprints():
    data = yaml.safe_load(QUALITY.read_text())
    data["data"].pop("generation_dtype", None)
    unset = recipe_from_dict(data)
    # Folders prepared before the field existed keep their fingerprint: unset leaves no trace.
    assert "generation_dtype" not in fingerprint_inputs(unset, [2, 15, 27, 30])["data"]
    assert generation_dtype(unset) == "float32"
    data["extraction"]["dtype"] = "float8_e4m3"
    assert generation_dtype(recipe_from_dict(data)) == "bfloat16"  # vLLM computes FP8 stores in bf16
    data["data"]["generation_dtype"] = "float32"
    assert generation_dtype(recipe_from_dict(data)) == "float32"
    data["data"]["generation_dtype"] = "float8_e4m3"
    with pytest.raises(RecipeError, match="data.generation_dtype"):
        recipe_from_dict(data)


def test_partial_file_keeps_finished_steps_and_cuts_a_torn_line(tmp_path):
    path = tmp_path / "generation" / "source-0.jsonl"
    partial = _Partial(str(path))
    partial.append({"first": 0, "text": "Hi?", "finish_reason": "stop"})
    partial.append(
        {"conversation": 0, "messages": [{"role": "user", "content": "Hi?"}], "drop": None, "cut": None}
    )
    partial.close()
    with open(path, "a") as f:
        f.write('{"first": 1, "text": "tor')  # a kill in the middle of a write
    again = _Partial(str(path))
    assert list(again.firsts) == [0] and list(again.conversations) == [0]
    again.append({"first": 1, "text": "Again", "finish_reason": "stop"})
    again.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line).get("first") for line in lines] == [0, None, 1]


def test_partial_file_of_a_remote_store_lives_under_the_local_home(tmp_path):
    local = DataLayout(str(tmp_path / "store" / "name-fp"))
    assert local.generation_partial(2, "/home") == str(
        tmp_path / "store" / "name-fp" / "generation" / "source-2.jsonl"
    )
    remote = DataLayout("s3://bucket/store/name-fp")
    assert remote.generation_partial(0, "/home/x") == "/home/x/generation/name-fp/source-0.jsonl"


def test_a_failed_generation_pass_is_set_aside_not_replayed(smollm2_tokenizer, tmp_path):
    """A target that writes only degenerate prompts (a wrong server) fails the pass; the next run,
    against a sane target, must ask afresh instead of replaying the cached garbage."""
    import asyncio

    from draftflow.data.self_generated import Sampled, SelfGenerationError, generate_conversations

    encoder = ChatEncoder(smollm2_tokenizer)
    settings = SelfGeneratedSection(num_prompts=3, topics=["chat"])
    path = tmp_path / "generation" / "source-0.jsonl"

    def sampler(text_of):
        async def sample(ids, max_tokens, temperature, top_p, seed):
            return Sampled(text_of(seed), "stop")

        return sample

    async def reply(messages, max_tokens):
        return "Sure, here is an answer."

    def run(text_of):
        return asyncio.run(
            generate_conversations(
                settings,
                encoder,
                sampler(text_of),
                reply,
                seed=0,
                reply_max_tokens=32,
                concurrency=2,
                partial_path=str(path),
            )
        )

    with pytest.raises(SelfGenerationError, match="no usable prompt") as failed:
        run(lambda seed: "for for for for for for for for for for for for for for for for")
    [aside] = path.parent.glob("source-0.failed-*.jsonl")
    assert str(aside) in str(failed.value) and not path.exists()
    questions = [
        "What is the capital of France?",
        "How do I bake sourdough bread at home?",
        "Can you explain how photosynthesis works in plants?",
        "Write a short poem about the sea in winter.",
    ]
    result = run(lambda seed: questions[seed % len(questions)])
    assert len(result.conversations) == 3 and result.resumed == 0
