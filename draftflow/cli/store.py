"""`draftflow store ls | verify | reconcile | compact | gc` on one data folder.

The folder is given as a URL (``STORE/NAME-FINGERPRINT``, any fsspec URL) or found from a
recipe with ``--recipe`` (its fingerprinted folder under ``extraction.store``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from draftflow.cli import add_overrides, add_storage_options, storage_options
from draftflow.recipe.load import RecipeError

_SUBCOMMANDS = {
    "ls": "summary: manifest files, shards, samples, tokens, orphan objects",
    "verify": "re-hash every listed shard; exits 1 and names each bad shard",
    "reconcile": "compare the prepared samples with the manifest; exits 1 if shards need (re)generating",
    "compact": "merge manifest fragments into one table (safe while writers run)",
    "gc": "delete uncommitted shard objects and temp files older than the grace period",
}


def register(sub: argparse._SubParsersAction) -> None:
    store = sub.add_parser("store", help="inspect and maintain a hidden-state data folder")
    ssub = store.add_subparsers(dest="store_command", required=True)
    for name, help_text in _SUBCOMMANDS.items():
        p = ssub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("url", nargs="?", help="the data folder, e.g. s3://bucket/store/NAME-FINGERPRINT")
        p.add_argument("--recipe", help="use this recipe's data folder instead of a URL")
        add_overrides(p)
        add_storage_options(p)
        p.set_defaults(func=_COMMANDS[name])
        if name == "reconcile":
            p.add_argument(
                "--samples-per-shard",
                type=int,
                default=None,
                help="without --recipe: default inferred from the manifest",
            )
            p.add_argument("--no-verify", action="store_true", help="check shard sizes only, do not re-hash")
        if name == "gc":
            p.add_argument("--grace-s", type=float, default=None, help="minimum age of what is deleted")
            p.add_argument("--dry-run", action="store_true", help="list what would be deleted")
            p.add_argument(
                "--force",
                action="store_true",
                help="delete even when the manifest lists no shard at all (every stored shard is then an orphan)",
            )


def _open(args: argparse.Namespace):
    """(Store, Plan or None) from the URL or --recipe; exactly one must be given."""
    from draftflow.plan import NOT_THE_STORE, Plan
    from draftflow.store import Store

    if bool(args.url) == bool(args.recipe):
        raise RecipeError("give the data folder URL or --recipe RECIPE (exactly one)")
    options = storage_options(args)
    if args.recipe:
        plan = Plan.load(args.recipe, args.overrides, storage_options=options, skip_storage=NOT_THE_STORE)
        return Store(plan.data, options), plan
    return Store.at(args.url, options), None


def cmd_ls(args: argparse.Namespace) -> int:
    from draftflow.store import ls

    store, _ = _open(args)
    print(ls(store))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from draftflow.store import verify

    store, _ = _open(args)
    report = verify(store)
    for bad in report.bad:
        print(f"BAD  shard {bad.shard_id}  {bad.shard_uri}: {bad.reason}")
    print(f"verified {report.checked} shards in {store.layout.root}: {len(report.bad)} bad")
    if report.bad:
        print("run `draftflow extract RECIPE` to regenerate bad shards", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_reconcile(args: argparse.Namespace) -> int:
    from draftflow.extraction import TrainSet
    from draftflow.store import read_manifest, reconcile

    store, plan = _open(args)
    try:
        expected = TrainSet.load(store).expected()
    except (FileNotFoundError, ValueError) as err:  # not prepared, or prepared data with unsafe ids
        print(f"error: {err}", file=sys.stderr)
        return 2
    manifest = read_manifest(store)
    if plan is not None:
        per_shard = plan.recipe.extraction.samples_per_shard
    else:
        per_shard = args.samples_per_shard or infer_samples_per_shard(
            manifest, [e.sample_id for e in expected]
        )
    rec = reconcile(store, expected, per_shard, manifest=manifest, verify=not args.no_verify)
    print(f"data folder  {store.layout.root} ({per_shard} samples per shard)")
    print(
        f"samples      {len(rec.present)} present, {len(rec.missing)} missing, {len(rec.failed)} failed, "
        f"{len(rec.corrupt)} corrupt, {len(rec.unexpected)} unexpected"
    )
    print(f"shards       {len(rec.complete_shards)} complete, {len(rec.to_generate)} to (re)generate")
    for shard in rec.to_generate:
        print(f"  {shard.shard_id} (attempt {shard.attempt}): {'; '.join(shard.reasons)}")
    for sample_id, reason in rec.failed[:20]:
        print(f"  failed {sample_id}: {reason}")
    if not rec.done:
        print("run `draftflow extract RECIPE` to (re)generate them", file=sys.stderr)
    return 0 if rec.done else 1


def infer_samples_per_shard(manifest, expected_ids: list[str]) -> int:
    """Rows per fragment (failed samples included): every shard but the last holds exactly that
    many. Accepted only if each listed shard holds exactly its slice of the expected order."""
    counts = Counter(manifest["shard_id"].to_pylist())
    if not counts:
        raise RecipeError("the manifest is empty: give --samples-per-shard or --recipe")
    size = max(counts.values())
    listed: dict[str, set[str]] = {}
    for shard_id, sample_id in zip(
        manifest["shard_id"].to_pylist(), manifest["sample_id"].to_pylist(), strict=True
    ):
        listed.setdefault(shard_id, set()).add(sample_id)
    for shard_id, ids in listed.items():
        k = int(shard_id)
        if ids != set(expected_ids[k * size : (k + 1) * size]):
            raise RecipeError(
                f"cannot infer samples per shard from the manifest (shard {shard_id} does not hold positions "
                f"{k * size}..{(k + 1) * size - 1}): give --samples-per-shard or --recipe"
            )
    return size


def cmd_compact(args: argparse.Namespace) -> int:
    from draftflow.store import compact

    store, _ = _open(args)
    url = compact(store)
    print(f"compacted into {url}" if url else "nothing to compact")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from draftflow.store import gc
    from draftflow.store.writer import MIN_GC_GRACE_S, ManifestEmpty

    store, _ = _open(args)
    if args.grace_s is not None and args.grace_s < MIN_GC_GRACE_S:
        print(
            f"error: --grace-s {args.grace_s:.0f} is below the minimum {MIN_GC_GRACE_S:.0f}s: shards uploaded "
            "but not yet committed, or read by a running trainer, could be deleted",
            file=sys.stderr,
        )
        return 2
    kwargs = {} if args.grace_s is None else {"grace_s": args.grace_s}
    try:
        report = gc(store, dry_run=args.dry_run, force=args.force, **kwargs)
    except ManifestEmpty as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    verb = "would delete" if args.dry_run else "deleted"
    for url in report.orphan_shards + report.temp_files:
        print(f"{verb} {url}")
    print(
        f"{verb} {len(report.orphan_shards)} orphan shards and {len(report.temp_files)} temp files; "
        f"kept {report.young_orphans_kept} younger orphans (maybe still being committed)"
    )
    return 0


_COMMANDS = {
    "ls": cmd_ls,
    "verify": cmd_verify,
    "reconcile": cmd_reconcile,
    "compact": cmd_compact,
    "gc": cmd_gc,
}
