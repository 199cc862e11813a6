"""Extraction against the real SmolLM2 vLLM server (CPU build): stores, CLI, sample-source modes.

One extraction to a local store (module fixture) is the reference the other tests compare with.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from extraction_helpers import (
    HIDDEN,
    LAYER_IDS,
    assert_bit_identical,
    copy_prepared,
    request_count,
    write_recipe_file,
)

from draftflow.cli import main as cli_main
from draftflow.data.dataset import load_prepared, read_report
from draftflow.extraction import expected_samples, extract_shard_by_id, run_extraction
from draftflow.plan import Plan
from draftflow.sample_source import MissingSamples, SampleSource
from draftflow.store import Store, load_sample, read_manifest, verify

pytestmark = pytest.mark.slow


@dataclass
class Run:
    recipe: str
    plan: Plan
    store: Store
    ids: list[str]

    def sample(self, sample_id: str):
        return load_sample(self.store, read_manifest(self.store), sample_id)


@pytest.fixture(scope="module")
def local_run(extraction_server, smollm2_dir: Path, tmp_path_factory) -> Run:
    work = tmp_path_factory.mktemp("local-run")
    recipe = write_recipe_file(
        work / "recipe.yaml",
        smollm2_dir,
        str(work / "store"),
        extraction_server.url,
        extraction_server.spec.staging_dir,
    )
    plan = Plan.load(recipe)
    summary = run_extraction(plan)
    assert summary.ok and summary.shards_written == 4 and summary.samples_ok == 16, summary
    store = Store(plan.data)
    return Run(recipe, plan, store, [e.sample_id for e in expected_samples(plan, store)])


def transformers_states(model, token_ids: list[int]) -> torch.Tensor:
    """[T, len(LAYER_IDS), H] from transformers; id 30 taken before the final norm (a hook)."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        hs = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    hook.remove()
    n = len(model.model.layers)
    return torch.stack([hs[i][0] if i < n else captured["last"][0] for i in LAYER_IDS], dim=1)


def test_end_to_end_local_store(local_run: Run, smollm2_dir: Path, staging_dir: Path):
    manifest = read_manifest(local_run.store)
    assert manifest["sample_id"].to_pylist() == local_run.ids  # each train sample once, in shard order
    assert set(manifest["status"].to_pylist()) == {"ok"}
    assert manifest["layer_ids"][0].as_py() == LAYER_IDS and manifest["hidden_size"][0].as_py() == HIDDEN
    assert set(manifest["dtype"].to_pylist()) == {"float32"} and set(manifest["mode"].to_pylist()) == {
        "offline"
    }
    assert manifest["vllm_version"][0].as_py().startswith("0.")
    assert verify(local_run.store).ok
    assert list(staging_dir.iterdir()) == []  # every staging file was deleted after reading

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prepared = {r["sample_id"]: r for r in load_prepared(local_run.plan.data, "train").to_pylist()}
    longest = max(local_run.ids, key=lambda sid: prepared[sid]["num_tokens"])
    for sid in (local_run.ids[0], longest):  # spot checks against transformers
        sample = local_run.sample(sid)
        assert sample.token_ids.tolist() == prepared[sid]["input_ids"]
        assert sample.loss_mask.tolist() == prepared[sid]["loss_mask"]
        want = transformers_states(model, prepared[sid]["input_ids"])
        got = sample.hidden_states
        assert got.shape == want.shape == (len(prepared[sid]["input_ids"]), len(LAYER_IDS), HIDDEN)
        # fp32, scaled per token: SmolLM2 has activation outliers of ~2.5e4 (see tests/vllm).
        bound = 1e-4 * want.abs() + 5e-4 * want.pow(2).mean(-1, keepdim=True).sqrt()
        worst = ((got - want).abs() / bound).amax(dim=(0, 2))
        assert (worst <= 1.0).all(), (
            f"sample {sid}: per-layer error / bound {worst.tolist()} (layers {LAYER_IDS})"
        )

    again = run_extraction(local_run.plan)  # complete: nothing is requested or written
    assert again.shards_written == 0 and again.samples_present_before == 16


def test_s3_store_reads_back_bit_identical(local_run: Run, s3):
    root = f"{s3['url']}/{uuid.uuid4().hex}/store"
    plan = Plan.load(local_run.recipe, [f"extraction.store={root}"])
    assert plan.fingerprint == local_run.plan.fingerprint  # the store location is not in the fingerprint
    summary = run_extraction(plan, storage_options=s3["storage_options"])
    assert summary.ok and summary.shards_written == 4
    remote = Store(plan.data, s3["storage_options"])
    assert remote.layout.root.startswith("s3://") and verify(remote).ok
    manifest = read_manifest(remote)
    assert manifest["sample_id"].to_pylist() == local_run.ids
    # vLLM on CPU in fp32 is deterministic for the same prompts: the two runs store the same bytes.
    local_manifest = read_manifest(local_run.store)
    for sid in local_run.ids:
        assert_bit_identical(
            load_sample(remote, manifest, sid, verify="sample"),
            load_sample(local_run.store, local_manifest, sid),
        )


def test_bit_flip_is_named_by_verify_and_regenerated(local_run: Run, tmp_path: Path, capsys):
    store_dir = tmp_path / "store"
    data = store_dir / Path(local_run.store.layout.root).name
    shutil.copytree(local_run.store.layout.root, data)
    store = Store.at(str(data))
    row = next(r for r in read_manifest(store).to_pylist() if r["shard_id"] == "000002")
    shard_file = Path(store.layout.resolve_shard_key(row["shard_uri"]))
    blob = bytearray(shard_file.read_bytes())
    blob[row["hidden_states_offset"] + 123] ^= 0x10
    shard_file.write_bytes(bytes(blob))

    assert cli_main(["store", "verify", str(data)]) == 1
    out = capsys.readouterr().out
    assert "BAD  shard 000002" in out and "sha256 mismatch" in out and "1 bad" in out
    assert cli_main(["store", "reconcile", str(data)]) == 1
    assert "000002 (attempt 2): corrupt: sha256 mismatch" in capsys.readouterr().out

    assert cli_main(["extract", local_run.recipe, "--set", f"extraction.store={store_dir}"]) == 0
    assert "1 of 4 shards written" in capsys.readouterr().out
    assert cli_main(["store", "verify", str(data)]) == 0
    assert (
        cli_main(
            ["store", "reconcile", "--recipe", local_run.recipe, "--set", f"extraction.store={store_dir}"]
        )
        == 0
    )
    manifest = read_manifest(store)
    assert manifest["sample_id"].to_pylist() == local_run.ids
    for sid in local_run.ids[8:12]:
        assert_bit_identical(load_sample(store, manifest, sid), local_run.sample(sid))


def fresh_plan(local_run: Run, tmp_path: Path, mode: str) -> Plan:
    """The same recipe on an empty data folder that has only the prepared samples."""
    plan = Plan.load(local_run.recipe, [f"extraction.store={tmp_path / 'store'}", f"extraction.mode={mode}"])
    copy_prepared(local_run.store.layout.root, plan.data.root)
    return plan


def test_hybrid_requests_only_missing_samples_and_keeps_them(
    local_run: Run, extraction_server, tmp_path: Path
):
    plan = fresh_plan(local_run, tmp_path, "hybrid")
    for shard in ("000000", "000001"):  # half the shards pre-generated, as a Prefect shard task would
        assert extract_shard_by_id(plan, shard, [extraction_server.url]).samples_ok == 4
    assert extract_shard_by_id(plan, "000000", [extraction_server.url]).skipped

    before = request_count(extraction_server.url)
    source = SampleSource(plan)
    ids = [sid for sid, _ in source.items()]
    assert ids == local_run.ids
    samples = source.load(ids)
    assert request_count(extraction_server.url) - before == 8  # shards 000002 and 000003 only
    for got in samples:
        assert_bit_identical(got, local_run.sample(got.sample_id))

    before = request_count(extraction_server.url)
    assert [s.sample_id for s in SampleSource(plan).load(ids)] == ids  # a later run loads what was kept
    assert request_count(extraction_server.url) == before
    manifest = read_manifest(Store(plan.data))
    assert manifest["sample_id"].to_pylist() == ids
    assert manifest["mode"].to_pylist() == ["offline"] * 8 + ["online"] * 8


def test_online_mode_leaves_no_files(local_run: Run, staging_dir: Path, tmp_path: Path):
    plan = fresh_plan(local_run, tmp_path, "online")
    files_before = sorted(p for p in Path(plan.data.root).rglob("*"))
    ids = local_run.ids[3:9]
    samples = SampleSource(plan).load(ids)
    assert [s.sample_id for s in samples] == ids
    for got in samples:
        assert_bit_identical(got, local_run.sample(got.sample_id))
    assert sorted(p for p in Path(plan.data.root).rglob("*")) == files_before
    assert list(staging_dir.iterdir()) == []


def test_offline_mode_names_what_is_missing(local_run: Run, extraction_server, tmp_path: Path):
    plan = fresh_plan(local_run, tmp_path, "offline")
    extract_shard_by_id(plan, "000001", [extraction_server.url])
    with pytest.raises(MissingSamples) as info:
        SampleSource(plan)
    message = str(info.value)
    assert "12 of 16 train samples are not in" in message and "12 missing" in message
    assert "3 shards to (re)generate: 000000 (4 missing), 000002 (4 missing), 000003 (4 missing)" in message


def test_regenerated_responses_through_the_extraction_server(
    extraction_server, write_recipe, staging_dir: Path
):
    recipe = write_recipe(
        extraction_server.url,
        num_samples=4,
        eval_samples=1,
        regenerate_responses=True,
        regenerate_max_tokens=16,
    )
    plan = Plan.load(recipe)
    summary = run_extraction(plan)
    assert summary.ok and summary.samples_ok == 3
    report = read_report(plan.data)
    assert report["regenerated"] is True and report["kept"] == {"train": 3, "eval": 1}
    for row in load_prepared(plan.data, "train").to_pylist():
        assert 0 < row["num_loss_tokens"] <= 17  # a reply of at most 16 tokens (+ end-of-turn)
    assert read_manifest(Store(plan.data))["sample_id"].to_pylist() == [
        e.sample_id for e in expected_samples(plan)
    ]
    assert list(staging_dir.iterdir()) == []  # chat requests' hidden-state files were deleted too
