"""The prepared dataset: selection, split, ids, regeneration plumbing, Parquet, token counts, reuse."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import pyarrow.parquet as pq
import pytest

from draftflow.data import prepare as prepare_module
from draftflow.data.chat import ChatEncoder
from draftflow.data.prepare import (
    SAMPLES_SCHEMA,
    eval_prompts,
    is_prepared,
    load_prepared,
    load_token_counts,
    prepare,
    prompt_messages,
    read_report,
    sample_id,
    select_conversations,
)
from draftflow.data.regenerate import regenerate_conversations
from draftflow.paths import DataLayout, safe_component
from draftflow.recipe.schema import DataSection, DataSource


@pytest.fixture(scope="module")
def encoder(smollm2_tokenizer):
    return ChatEncoder(smollm2_tokenizer)


@pytest.fixture
def sources(write_json, sg):
    """Two sources: 30 ShareGPT conversations (2 of them unusable) and 12 `messages` ones."""
    records = sg.records(30)
    records[3] = sg.record(("human", "no reply"))
    records[7] = {"conversations": []}
    messages = [
        {
            "messages": [
                {"role": "user", "content": f"m{i}: name a colour"},
                {"role": "assistant", "content": f"Blue {i}"},
                {"role": "user", "content": "another"},
                {"role": "assistant", "content": f"Red {i}"},
            ]
        }
        for i in range(12)
    ]
    return [
        DataSource(kind="sharegpt", path=str(write_json("sg.json", records))),
        DataSource(kind="messages", path=str(write_json("m.jsonl", messages, jsonl=True))),
    ]


def data_section(sources, **overrides) -> DataSection:
    return DataSection(sources=sources, **{"eval_samples": 5, "seed": 1, "max_length": 256, **overrides})


def layout(tmp_path, name="store") -> DataLayout:
    return DataLayout.for_recipe(str(tmp_path / name), "test", "0123456789abcdef")


def test_prepare_writes_parquet_counts_and_report(tmp_path, sources, encoder):
    lay = layout(tmp_path)
    result = prepare(data_section(sources), lay, encoder)
    assert not result.reused and is_prepared(lay)
    table = load_prepared(lay)
    assert table.schema == SAMPLES_SCHEMA
    assert pq.read_schema(lay.samples) == SAMPLES_SCHEMA  # on-disk types, not just the cast on read
    report = read_report(lay)
    assert report == result.report
    assert table.num_rows == 28 + 12 == report["kept"]["train"] + report["kept"]["eval"]
    assert report["kept"]["eval"] == 5
    labels = list(report["sources"])
    assert report["sources"][labels[0]]["dropped"] == {"empty": 1, "no_assistant_turn": 1}
    assert report["sources"][labels[1]]["usable"] == 12
    assert sum(s["kept"]["train"] + s["kept"]["eval"] for s in report["sources"].values()) == table.num_rows

    # Roundtrip: every row is exactly the encoder's output for the stored conversation.
    for row in table.to_pylist():
        messages = json.loads(row["messages"])
        encoded, _ = encoder.encode(messages, 256)
        assert row["input_ids"] == encoded.input_ids and row["loss_mask"] == encoded.loss_mask
        assert row["num_tokens"] == len(encoded.input_ids)
        assert row["num_loss_tokens"] == sum(encoded.loss_mask)
        assert row["sample_id"] == sample_id(messages)
        assert row["source"] in labels


def test_token_counts_equal_a_recount_over_train_loss_tokens(tmp_path, sources, encoder):
    lay = layout(tmp_path)
    prepare(data_section(sources), lay, encoder)
    recount = Counter()
    for row in load_prepared(lay, "train").to_pylist():
        recount.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    assert load_token_counts(lay) == dict(recount)
    assert read_report(lay)["tokens"]["train_loss"] == sum(recount.values())


def test_split_is_disjoint_and_deterministic_by_seed(tmp_path, sources, encoder):
    def splits(name, seed):
        lay = layout(tmp_path, name)
        prepare(data_section(sources, seed=seed), lay, encoder)
        rows = load_prepared(lay).select(["sample_id", "split"]).to_pylist()
        train = {r["sample_id"] for r in rows if r["split"] == "train"}
        return train, [r["sample_id"] for r in rows if r["split"] == "eval"]

    train_a, eval_a = splits("a", seed=1)
    train_b, eval_b = splits("b", seed=1)
    _, eval_c = splits("c", seed=2)
    assert not train_a & set(eval_a)
    assert (train_a, eval_a) == (train_b, eval_b)
    assert set(eval_c) != set(eval_a)
    assert [p.sample_id for p in eval_prompts(layout(tmp_path, "a"))] == eval_a


def test_sample_ids_stable_distinct_and_path_safe(sources):
    first, _ = select_conversations(data_section(sources))
    again, _ = select_conversations(data_section(sources))
    assert [c.sample_id for c in first] == [c.sample_id for c in again]
    ids = [c.sample_id for c in first]
    assert len(set(ids)) == len(ids) == 40
    assert all(safe_component(i) == i and len(i) == 16 for i in ids)
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert sample_id(conv) != sample_id([conv[0], {"role": "assistant", "content": "c"}])
    assert sample_id(conv) == "8a02dbdda04f507f"  # pinned: ids name shards, they must not drift


def test_duplicates_across_sources_kept_once(write_json, sg):
    recs = sg.records(4)
    a = DataSource(kind="sharegpt", path=str(write_json("a.json", recs)))
    b = DataSource(
        kind="sharegpt", path=str(write_json("b.jsonl", recs[:2] + sg.records(1, "new"), jsonl=True))
    )
    chosen, stats = select_conversations(DataSection(sources=[a, b], eval_samples=0))
    assert len(chosen) == 5
    assert list(stats.values())[1]["dropped"] == {"duplicate": 2}


def test_max_samples_per_source_then_total_cap(write_json, sg):
    a = DataSource(kind="sharegpt", path=str(write_json("a.json", sg.records(20, "a"))), max_samples=6)
    b = DataSource(kind="sharegpt", path=str(write_json("b.json", sg.records(20, "b"))), max_samples=8)
    chosen, stats = select_conversations(DataSection(sources=[a, b], eval_samples=2))
    assert [s["selected"] for s in stats.values()] == [6, 8]
    assert len(chosen) == 14 and Counter(c.split for c in chosen) == {"train": 12, "eval": 2}
    capped, _ = select_conversations(DataSection(sources=[a, b], num_samples=10, eval_samples=2))
    assert len(capped) == 10
    # The cap keeps a prefix of the same order: a bigger cap never reshuffles the smaller one.
    assert [c.sample_id for c in capped] == [c.sample_id for c in chosen[:10]]


def test_truncation_counted_in_report(tmp_path, write_json, sg, encoder):
    long = [sg.record(("human", "tell me a long story"), ("gpt", "word " * 300))] + sg.records(5)
    src = DataSource(kind="sharegpt", path=str(write_json("long.json", long)))
    lay = layout(tmp_path)
    report = prepare(DataSection(sources=[src], eval_samples=0, max_length=64), lay, encoder).report
    assert report["truncated"] == 1
    assert max(load_prepared(lay)["num_tokens"].to_pylist()) == 64


def test_eval_prompts_stop_before_the_first_reply(tmp_path, sources, encoder):
    lay = layout(tmp_path)
    prepare(data_section(sources), lay, encoder)
    prompts = eval_prompts(lay)
    assert len(prompts) == 5 and len(eval_prompts(lay, limit=2)) == 2
    for p in prompts:
        assert p.messages and p.messages[-1]["role"] == "user"
        assert all(m["role"] != "assistant" for m in p.messages)
    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u2"},
    ]
    assert prompt_messages(conv) == conv[:2]


def test_existing_prepared_data_is_reused(tmp_path, sources, encoder, monkeypatch):
    lay = layout(tmp_path)
    prepare(data_section(sources), lay, encoder)
    stamp = os.stat(lay.samples).st_mtime_ns
    monkeypatch.setattr(prepare_module, "select_conversations", lambda *_: pytest.fail("re-prepared"))
    again = prepare(data_section(sources), lay, encoder)
    assert again.reused and again.report == read_report(lay)
    assert os.stat(lay.samples).st_mtime_ns == stamp


def test_crash_while_writing_leaves_nothing_visible(tmp_path, sources, encoder, monkeypatch):
    lay = layout(tmp_path)
    real_write = pq.write_table
    calls = []

    def crash_on_second_file(table, where, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            where.write(b"PAR1 half a file")
            raise OSError("disk full")
        return real_write(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", crash_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        prepare(data_section(sources), lay, encoder)
    prepared_dir = tmp_path / "store" / "test-0123456789abcdef" / "prepared"
    # both tables are built before anything is written: not even a partial file
    assert not prepared_dir.exists() or list(prepared_dir.iterdir()) == []
    assert not is_prepared(lay)
    with pytest.raises(FileNotFoundError, match="interrupted"):
        load_prepared(lay)
    monkeypatch.setattr(pq, "write_table", real_write)
    assert not prepare(data_section(sources), lay, encoder).reused
    assert is_prepared(lay)


def test_no_training_samples_is_an_error(tmp_path, write_json, sg, encoder):
    src = DataSource(kind="sharegpt", path=str(write_json("few.json", sg.records(3))))
    with pytest.raises(ValueError, match="no training samples"):
        prepare(DataSection(sources=[src], eval_samples=3), layout(tmp_path), encoder)
    assert not is_prepared(layout(tmp_path))


# ---------------------------------------------------------------------------------------
# Response regeneration (fake async generate: the real vLLM client is tested elsewhere)
# ---------------------------------------------------------------------------------------


class FakeTarget:
    """Replies 'REGEN <n>: <last user text>'; can fail, stall or go silent for chosen prompts."""

    def __init__(self, fail_on=(), empty_on=(), stall_on=()):
        self.fail_on, self.empty_on, self.stall_on = fail_on, empty_on, stall_on
        self.calls: list[tuple[list[dict], int]] = []
        self.in_flight = self.peak = 0

    async def __call__(self, messages, max_tokens):
        self.calls.append((messages, max_tokens))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0.002)
            last = messages[-1]["content"]
            if any(s in last for s in self.fail_on):
                raise ConnectionError("server said 500")
            if any(s in last for s in self.stall_on):
                await asyncio.sleep(10)
            if any(s in last for s in self.empty_on):
                return "  "
            return f"REGEN {len(self.calls)}: {last}"
        finally:
            self.in_flight -= 1


def test_regeneration_replaces_assistant_turns_in_order():
    conv = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "old1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "old2"},
    ]
    fake = FakeTarget()
    [(out, reason)], errors = asyncio.run(regenerate_conversations([conv], fake, max_tokens=7, concurrency=2))
    assert reason is None and not errors
    assert [m["content"] for m in out] == ["sys", "u1", "REGEN 1: u1", "u2", "REGEN 2: u2"]
    # The second reply is conditioned on the regenerated first one, never on the old text.
    assert fake.calls[1][0][2]["content"] == "REGEN 1: u1" and fake.calls[1][1] == 7
    assert fake.calls[0][0] == conv[:2]
    assert conv[2]["content"] == "old1"  # the input is not mutated


def test_regeneration_failures_are_counted_and_bounded():
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}] for i in range(20)]
    convs[3][0]["content"] = "q3 FAIL"
    convs[5][0]["content"] = "q5 EMPTY"
    convs[8][0]["content"] = "q8 STALL"
    fake = FakeTarget(fail_on=["FAIL"], empty_on=["EMPTY"], stall_on=["STALL"])
    results, errors = asyncio.run(regenerate_conversations(convs, fake, 16, concurrency=3, timeout_s=0.5))
    reasons = {i: r for i, (_, r) in enumerate(results) if r}
    assert reasons == {3: "regenerate_failed", 5: "regenerate_empty", 8: "regenerate_timeout"}
    assert errors == ["ConnectionError: server said 500"]
    assert 1 < fake.peak <= 3
    assert all(out[1]["content"].startswith("REGEN") for out, r in results if r is None)


def test_prepare_with_regeneration(tmp_path, sources, encoder):
    fake = FakeTarget(fail_on=["q question 11"])
    lay = layout(tmp_path)
    data = data_section(
        sources, regenerate_responses=True, regenerate_max_tokens=32, regenerate_concurrency=4
    )
    report = prepare(data, lay, encoder, generate=fake).report
    assert report["regenerated"] and report["dropped"] == {"regenerate_failed": 1}
    assert report["regenerate_errors"] == ["ConnectionError: server said 500"]
    rows = load_prepared(lay).to_pylist()
    assert len(rows) == 39
    for row in rows:
        replies = [m["content"] for m in json.loads(row["messages"]) if m["role"] == "assistant"]
        assert replies and all(r.startswith("REGEN ") for r in replies)
    # Ids name the source conversation, so they match a run without regeneration.
    plain, _ = select_conversations(data_section(sources))
    assert {r["sample_id"] for r in rows} <= {c.sample_id for c in plain}
    assert all(max_tokens == 32 for _, max_tokens in fake.calls)


def test_regeneration_needs_a_generate_function(tmp_path, sources, encoder):
    with pytest.raises(ValueError, match="generate"):
        prepare(data_section(sources, regenerate_responses=True), layout(tmp_path), encoder)


def test_prepare_with_regeneration_inside_a_running_event_loop(tmp_path, sources, encoder):
    async def main():  # e.g. an async orchestration flow calling the sync API
        return prepare(
            data_section(sources, regenerate_responses=True), layout(tmp_path), encoder, generate=FakeTarget()
        )

    assert asyncio.run(main()).report["kept"]["train"] == 35


@pytest.mark.slow
def test_prepare_on_object_storage(s3, sources, encoder):
    """The same code on a real S3 endpoint (moto on loopback): temp object, move, reuse, load."""
    import s3fs

    options = s3["storage_options"]
    lay = DataLayout.for_recipe(s3["url"] + "/store", "test", "0123456789abcdef")
    first = prepare(data_section(sources), lay, encoder, storage_options=options)
    assert not first.reused and is_prepared(lay, options)
    assert load_prepared(lay, "eval", options).num_rows == 5
    assert read_report(lay, options) == first.report
    assert sum(load_token_counts(lay, options).values()) == first.report["tokens"]["train_loss"]
    objects = s3fs.S3FileSystem(**options).find(s3["url"] + "/store")
    assert sorted(o.rsplit("/", 1)[1] for o in objects) == [
        "report.json",
        "samples.parquet",
        "token_counts.parquet",
    ]
    assert prepare(data_section(sources), lay, encoder, storage_options=options).reused


@pytest.mark.slow
def test_demo_recipe_on_the_pip_corpora(smollm2_dir, tmp_path):
    """The shipped CPU demo recipe end to end (real chatterbot + chitchat data, real tokenizer)."""
    from draftflow.data.prepare import prepare_recipe
    from draftflow.recipe import load_recipe

    demo = prepare_module.__file__.rsplit("/draftflow/", 1)[0] + "/recipes/smollm2-135m-dflash-cpu.yaml"
    recipe = load_recipe(demo)
    lay = DataLayout.for_recipe(str(tmp_path), recipe.name, "0123456789abcdef")
    fake = FakeTarget()
    result = prepare_recipe(recipe, lay, generate=fake)
    report = result.report
    data = recipe.data
    assert report["selected"] == data.num_samples and report["kept"]["eval"] == data.eval_samples
    assert (
        report["kept"]["train"] + report["kept"]["eval"] + sum(report["dropped"].values()) == data.num_samples
    )
    assert {s["kind"] for s in report["sources"].values()} == {"chatterbot", "chitchat"}
    assert [s["selected"] for s in report["sources"].values()] == [src.max_samples for src in data.sources]
    assert all(m == data.regenerate_max_tokens for _, m in fake.calls)
    assert max(load_prepared(lay)["num_tokens"].to_pylist()) <= data.max_length
    assert prepare_recipe(recipe, lay).reused  # no tokenizer load, no generate needed


def test_async_prepare_runs_generate_on_the_callers_loop(tmp_path, sources, encoder):
    from draftflow.data.prepare import aprepare

    loops = set()

    async def generate(messages, max_tokens):
        loops.add(asyncio.get_running_loop())
        return "ok"

    async def main():
        result = await aprepare(
            data_section(sources, regenerate_responses=True), layout(tmp_path), encoder, generate=generate
        )
        return result, asyncio.get_running_loop()

    result, caller_loop = asyncio.run(main())
    assert loops == {caller_loop}
    assert result.report["kept"]["train"] == 35 and is_prepared(layout(tmp_path))


def test_regeneration_stops_when_the_server_keeps_failing():
    from draftflow.data.regenerate import RegenerationError

    convs = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}] for i in range(500)
    ]
    down = FakeTarget(fail_on=[""])  # every request fails, like a server that is down

    async def main():
        with pytest.raises(RegenerationError, match="50 regeneration requests failed in a row"):
            await regenerate_conversations(convs, down, 16, concurrency=4)
        calls = len(down.calls)
        await asyncio.sleep(0.05)
        assert len(down.calls) == calls and down.in_flight == 0  # no worker left running

    asyncio.run(main())
    assert len(down.calls) < 50 + 4  # stopped at once, not after trying all 500


def test_prepare_when_every_regeneration_fails(tmp_path, sources, encoder):
    with pytest.raises(ValueError, match="no training samples left .*regenerate_failed"):
        prepare(
            data_section(sources, regenerate_responses=True),
            layout(tmp_path),
            encoder,
            generate=FakeTarget(fail_on=[""]),
        )
    assert not is_prepared(layout(tmp_path))


def test_mix_is_not_biased_towards_the_bigger_source(write_json, sg):
    """Per-source caps keep the smallest hash keys; the mix must not reuse them, or the big
    source (whose kept keys are all small) would take the eval split and the total cap."""
    small = DataSource(
        kind="sharegpt", path=str(write_json("s.json", sg.records(300, "small"))), max_samples=150
    )
    big = DataSource(
        kind="sharegpt", path=str(write_json("b.json", sg.records(3000, "big"))), max_samples=150
    )
    chosen, _ = select_conversations(DataSection(sources=[small, big], num_samples=200, eval_samples=40))
    by_source = Counter(c.source.split(":")[2] for c in chosen)
    eval_by_source = Counter(c.source.split(":")[2] for c in chosen if c.split == "eval")
    assert 70 <= by_source["s.json"] <= 130  # ~100 each; the biased order gives ~20 / ~180
    assert 8 <= eval_by_source["s.json"] <= 32


def test_a_second_preparation_never_rewrites_the_folder(tmp_path, sources, encoder):
    """Two preparations of one fingerprint, the second finishing after the first (whose extraction
    may already read the files): the first's files stay, byte for byte, and the second uses them.
    Regenerated replies differ per run, so a rewrite would be visible in the data itself."""
    import threading

    lay = layout(tmp_path)
    data = data_section(sources, regenerate_responses=True)
    first_done = threading.Event()
    results = {}

    def generator(reply: str, wait: threading.Event | None):
        async def generate(messages, max_tokens):
            if wait is not None:
                await asyncio.to_thread(wait.wait, 60)
            return reply

        return generate

    def run(name: str, wait: threading.Event | None):
        results[name] = prepare(data, lay, encoder, generate=generator(f"reply from {name}", wait))

    late = threading.Thread(target=run, args=("late", first_done))
    late.start()  # checks the folder (empty), then regenerates until the first one has finished
    run("first", None)
    written = {p: p.read_bytes() for p in lay_dir(lay).iterdir()}
    first_done.set()
    late.join(120)
    assert not results["first"].reused and results["late"].reused
    assert results["late"].report == results["first"].report == read_report(lay)
    assert {p: p.read_bytes() for p in lay_dir(lay).iterdir()} == written  # nothing rewritten, no leftovers
    texts = load_prepared(lay)["messages"].to_pylist()
    assert all("reply from first" in t and "reply from late" not in t for t in texts)


def lay_dir(lay: DataLayout):
    from pathlib import Path

    return Path(lay.prepared_dir)


def test_flipped_bit_in_prepared_tables_is_detected(tmp_path, sources, encoder):
    from draftflow.data.dataset import CorruptPreparedData

    lay = layout(tmp_path)
    prepare(data_section(sources), lay, encoder)
    for url, load in (
        (lay.samples, lambda: load_prepared(lay)),
        (lay.token_counts, lambda: load_token_counts(lay)),
    ):
        blob = bytearray(open(url, "rb").read())
        blob[len(blob) // 2] ^= 0x10
        with open(url, "r+b") as f:  # in place, same size: only a checksum can tell
            f.write(blob)
        with pytest.raises(CorruptPreparedData, match=r"samples.parquet|token_counts.parquet") as info:
            load()
        assert url.rsplit("/", 1)[1] in str(info.value) and "prepare again" in str(info.value)


def test_files_of_a_preparation_that_died_are_replaced(tmp_path, sources, encoder):
    lay = layout(tmp_path)
    first = prepare(data_section(sources), lay, encoder)
    os.remove(lay.prepare_report)  # died between the tables and the report
    os.utime(lay.samples, (1, 1))  # long ago: nobody is about to write the report
    again = prepare(data_section(sources), lay, encoder)
    assert not again.reused and is_prepared(lay) and again.report == first.report
