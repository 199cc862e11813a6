"""Evaluate an exported checkpoint: contract check, offline simulator, vLLM, agreement, gate.

:func:`evaluate_checkpoint` takes the prompts from the recipe's held-out eval split (never
train; the first ``evaluation.num_prompts``), renders them with the target's chat template
(generation prompt added) and runs, on the SAME prompt token ids and draft length:

1. the contract check of the folder against its ``provenance.json`` (a broken contract writes
   a report naming the problems and raises :class:`ContractError` before any model runs);
2. the offline simulator (transformers target, drafter loaded from the exported files);
3. optionally vLLM serving the target with the checkpoint as its drafter;
4. the agreement check (relative τ gap within ``evaluation.agreement_tolerance``) and the gate
   (τ >= ``evaluation.min_acceptance_length``; when vLLM measured the speed-up over the target,
   speed-up >= ``evaluation.min_speedup`` and above each ``evaluation.must_beat`` baseline's,
   measured in the same rounds).

``report.json``, ``report.md`` and ``acceptance.png`` are written first; a disagreement then
raises :class:`AgreementError` naming both τ values. A failed gate does not raise: the
returned :class:`Evaluation` says so (``passed_gate``, ``publishable``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from draftflow.data.chat import load_chat_encoder
from draftflow.data.dataset import eval_prompts
from draftflow.evaluation.baselines import BaselineUnavailable, check_available
from draftflow.evaluation.contract import ContractError, check_contract
from draftflow.evaluation.in_vllm import (
    LaunchServerFactory,
    ServerFactory,
    VLLMResult,
    evaluate_in_vllm,
)
from draftflow.evaluation.offline import OfflineResult, evaluate_offline
from draftflow.evaluation.report import Evaluation
from draftflow.models import algorithm_class, speculators
from draftflow.paths import RunLayout
from draftflow.plan import Plan
from draftflow.process_env import storage_options_from_env
from draftflow.recipe.load import expand
from draftflow.remote import is_remote, local_copy, url_to_fs
from draftflow.vllm.plugin import installed_fixes

if TYPE_CHECKING:
    from draftflow.refresh import Champion


class AgreementError(RuntimeError):
    """Offline and vLLM acceptance differ by more than the recipe's tolerance."""


class EvaluationError(RuntimeError):
    """The evaluation cannot run as asked (no prompts, no way to start vLLM)."""


@dataclass
class EvalRun:
    """An evaluation with what produced it (token ids per prompt from each evaluator)."""

    evaluation: Evaluation
    offline: OfflineResult | None = None
    vllm: VLLMResult | None = None
    paths: dict[str, str] = field(default_factory=dict)


def default_eval_dir(checkpoint_dir: str | Path) -> str:
    """``RUN/eval`` for a run's ``RUN/export`` folder, else ``<checkpoint>-eval`` beside it."""
    if is_remote(str(checkpoint_dir)):
        parent, _, name = str(checkpoint_dir).rstrip("/").rpartition("/")
        return RunLayout(parent).eval_dir if name == "export" else f"{parent}/{name}-eval"
    folder = Path(checkpoint_dir).resolve()
    if folder.name == "export":
        return RunLayout(str(folder.parent)).eval_dir
    return str(folder.with_name(folder.name + "-eval"))


def write_evaluation(
    evaluation: Evaluation, out_dir: str, storage_options: dict | None = None
) -> dict[str, str]:
    """report.json, report.md, acceptance.png into a local folder or an fsspec URL (``storage_options``
    None: the environment's)."""
    if not is_remote(out_dir):
        local = Path(out_dir.removeprefix("file://"))
        return {k: str(v) for k, v in evaluation.write(local).items()}
    fs, root = url_to_fs(out_dir, storage_options)
    with tempfile.TemporaryDirectory() as tmp:
        paths = evaluation.write(Path(tmp))
        out = {}
        for key, path in paths.items():
            fs.put_file(str(path), f"{root.rstrip('/')}/{path.name}")
            out[key] = f"{out_dir.rstrip('/')}/{path.name}"
    return out


def evaluate_prompts(
    checkpoint_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    target: str,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    min_acceptance_length: float,
    agreement_tolerance: float,
    prompt_names: Sequence[str] | None = None,
    in_vllm: bool = False,
    server_factory: ServerFactory | None = None,
    out_dir: str | Path | None = None,
    target_info=None,
    fingerprint: str | None = None,
    strict_contract: bool = True,
    speculative_config: dict | None = None,
    measure_baseline: bool = True,
    speed_rounds: int = 1,
    interleave: bool = False,
    model=None,
    meta: dict | None = None,
    storage_options: dict | None = None,
    min_speedup: float | None = None,
    must_beat: Sequence[str] = (),
    champion: tuple[str, str] | None = None,
    champion_margins: dict | None = None,
) -> EvalRun:
    """Everything :func:`evaluate_checkpoint` does once the prompts are token ids. A remote
    ``checkpoint_dir`` (an export on s3://) is evaluated from a local copy; the report names the URL.
    ``min_speedup`` and ``must_beat``: the speed gate; the ``must_beat`` baselines are decoded beside
    the drafter when vLLM measures the speed-up (``in_vllm`` and ``measure_baseline``). ``champion``:
    (version, local folder) of the drafter in service, decoded beside this one on a refresh run;
    ``champion_margins``: what this one must beat it by (the gate)."""
    checkpoint = str(checkpoint_dir)
    local = str(local_copy(checkpoint, storage_options))
    problems = check_contract(local, target_info, verifier=target, fingerprint=fingerprint)
    evaluation = Evaluation(
        None,
        None,
        min_acceptance_length,
        agreement_tolerance,
        checkpoint,
        contract_problems=problems,
        meta=dict(meta or {}, max_new_tokens=max_new_tokens),
        checkpoint_digest=speculators.checkpoint_digest(local),
        min_speedup=min_speedup,
        must_beat=list(must_beat),
        champion_margins=champion_margins,
    )
    run = EvalRun(evaluation)
    if problems and strict_contract:
        if out_dir is not None:
            run.paths = write_evaluation(evaluation, str(out_dir), storage_options)
        raise ContractError(
            f"{checkpoint}: checkpoint contract broken (nothing evaluated):\n- " + "\n- ".join(problems)
        )
    if in_vllm and server_factory is None:
        raise EvaluationError("evaluation in vLLM needs a server factory (recipe: vllm.launch settings)")
    draft_length = (speculative_config or {}).get("num_speculative_tokens")
    run.offline = evaluate_offline(
        local,
        prompts,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        target=target,
        model=model,
        prompt_names=prompt_names,
        draft_length=draft_length,
    )
    evaluation.offline = run.offline.report
    if in_vllm:
        run.vllm = evaluate_in_vllm(
            local,
            prompts,
            max_new_tokens=max_new_tokens,
            server_factory=server_factory,
            prompt_names=prompt_names,
            speculative_config=speculative_config,
            measure_baseline=measure_baseline,
            speed_rounds=speed_rounds,
            interleave=interleave,
            baselines=list(must_beat) if measure_baseline else (),
            champion=champion if measure_baseline else None,
        )
        same = sum(a == b for a, b in zip(run.vllm.outputs, run.offline.outputs))
        run.vllm.report.notes.append(f"{same}/{len(prompts)} outputs identical to the offline simulator's")
        evaluation.vllm = run.vllm.report
    if out_dir is not None:
        run.paths = write_evaluation(evaluation, str(out_dir), storage_options)
    message = evaluation.disagreement()
    if message:
        where = f"; report in {run.paths['report']}" if run.paths else ""
        hint = f" ({evaluation.meta['known_issue']})" if evaluation.meta.get("known_issue") else ""
        raise AgreementError(message + where + hint)
    return run


def known_vllm_issue(
    checkpoint_dir: str | Path, device: str, fixes: frozenset[str] = frozenset()
) -> str | None:
    """A defect of the vLLM build that makes its acceptance differ from the simulator's, unless
    ``fixes`` (:func:`draftflow.vllm.plugin.installed_fixes` of the serving virtualenv) remove it."""
    try:
        config = speculators.read_config(checkpoint_dir)
        kind = algorithm_class(speculators.model_type(config))
    except (OSError, ValueError):  # the contract check reports an unreadable folder or an unknown kind
        return None
    return kind.known_serving_issue(config, device, fixes)


def serving_fixes(launch) -> frozenset[str]:
    """What draftflow's vLLM plugin fixes in the virtualenv ``launch`` (vllm.launch) starts servers from.
    Only CPU builds have a defect it fixes: a GPU launch is not probed."""
    if launch is None or launch.device != "cpu":
        return frozenset()
    return installed_fixes(expand(launch.python), launch.env)


def load_eval_prompts(
    plan: Plan,
    encoder,
    *,
    limit: int,
    storage_options: dict | None = None,
    max_total_tokens: int | None = None,
) -> tuple[list[str], list[list[int]], int]:
    """(sample ids, prompt token ids, dropped) from the held-out eval split, chat template applied
    by ``encoder`` (a :class:`~draftflow.data.chat.ChatEncoder`, generation prompt added).

    A prompt whose length plus ``evaluation.max_new_tokens`` exceeds ``max_total_tokens`` (the
    server's max_model_len) is dropped and counted.
    """
    names, ids, dropped = [], [], 0
    for prompt in eval_prompts(plan.data, limit=limit, storage_options=storage_options):
        tokens = encoder.prompt_ids(prompt.messages)
        if (
            max_total_tokens is not None
            and len(tokens) + plan.recipe.evaluation.max_new_tokens > max_total_tokens
        ):
            dropped += 1
            continue
        names.append(prompt.sample_id)
        ids.append(tokens)
    return names, ids, dropped


def load_prompt_set(
    plan: Plan, encoder, *, max_total_tokens: int | None = None
) -> tuple[list[str], list[list[int]], int, dict[str, str]]:
    """(prompt ids, token ids, dropped, {prompt id: category}) of the recipe's ``evaluation.prompt_set``
    (see :mod:`draftflow.evaluation.categories`), chat template applied, too-long prompts dropped."""
    from draftflow.evaluation import categories as cat

    ev = plan.recipe.evaluation
    names, ids, dropped, kinds = [], [], 0, {}
    for prompt in cat.load_prompt_set(ev.prompt_set, ev.prompts_per_category):
        tokens = encoder.prompt_ids(prompt.messages)
        if max_total_tokens is not None and len(tokens) + ev.max_new_tokens > max_total_tokens:
            dropped += 1
            continue
        names.append(prompt.prompt_id)
        ids.append(tokens)
        kinds[prompt.prompt_id] = prompt.category
    return names, ids, dropped, kinds


def evaluate_checkpoint(
    checkpoint_dir: str | Path,
    plan_or_recipe: Plan | str | Path,
    *,
    in_vllm: bool | None = None,
    server_factory: ServerFactory | None = None,
    out_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    storage_options: dict | None = None,
    strict_contract: bool = True,
    speculative_config: dict | None = None,
    champion: Champion | None = None,
) -> Evaluation:
    """Evaluate the exported ``checkpoint_dir`` for a recipe (a :class:`Plan`, or a recipe path
    with ``overrides``); see the module doc. ``in_vllm`` None: the recipe's
    ``evaluation.in_vllm``. ``server_factory`` None: start servers from ``vllm.launch``.
    ``out_dir`` None: :func:`default_eval_dir`. ``champion``: the drafter in service
    (:func:`draftflow.refresh.find_champion`), raced beside this one on a refresh run."""
    if storage_options is None:  # `draftflow evaluate`: the store's options come from the environment
        storage_options = storage_options_from_env()
    plan = (
        plan_or_recipe
        if isinstance(plan_or_recipe, Plan)
        else Plan.load(str(plan_or_recipe), list(overrides), storage_options=storage_options)
    )
    ev, launch = plan.recipe.evaluation, plan.recipe.vllm.launch
    in_vllm = ev.in_vllm if in_vllm is None else in_vllm
    interleave = ev.speed_schedule == "interleaved" and ev.measure_speedup  # both servers up at once
    out = str(out_dir) if out_dir is not None else default_eval_dir(checkpoint_dir)
    if in_vllm and ev.measure_speedup and ev.must_beat and launch is not None:
        try:  # before any server starts: vLLM would fail the baseline's only after loading the target
            check_available(ev.must_beat, expand(launch.python), launch.env)
        except BaselineUnavailable as err:
            raise EvaluationError(str(err)) from None
    if in_vllm and server_factory is None:
        if launch is None:
            raise EvaluationError(
                "evaluation in vLLM starts its own server (target + this drafter): the recipe "
                "needs vllm.launch settings, or pass --no-vllm"
            )
        log_dir = None if is_remote(out) else out
        server_factory = LaunchServerFactory(launch, log_dir=log_dir, side_by_side=interleave)
    encoder = load_chat_encoder(plan.recipe.target)
    max_total = launch.max_model_len if in_vllm and launch is not None else None
    categories: dict[str, str] = {}
    if ev.prompt_set == "held_out":
        names, prompts, dropped = load_eval_prompts(
            plan, encoder, limit=ev.num_prompts, max_total_tokens=max_total, storage_options=storage_options
        )
    else:
        names, prompts, dropped, categories = load_prompt_set(plan, encoder, max_total_tokens=max_total)
    if not prompts:
        raise EvaluationError(
            f"no eval prompts ({ev.prompt_set}) in {plan.data.prepared_dir} "
            f"(data.eval_samples {plan.recipe.data.eval_samples}, {dropped} too long for "
            f"max_model_len {max_total})"
        )
    meta = {
        "recipe": plan.recipe.name,
        "fingerprint": plan.fingerprint,
        "target": plan.target_model,
        "prompts": len(prompts),
        "dropped_too_long": dropped,
        "prompt_ids": names,
        "prompt_set": ev.prompt_set,
    }
    if categories:
        meta["prompt_categories"] = categories
    refresh = plan.recipe.refresh
    margins = None
    if refresh is not None:
        margins = {"acceptance": refresh.min_gain_acceptance, "speedup": refresh.min_gain_speedup}
        meta["champion"] = champion.version if champion else None
        if champion is not None and not (in_vllm and ev.measure_speedup):
            raise EvaluationError(
                "a refresh races the new drafter against the one in service in vLLM: it needs "
                "evaluation.in_vllm and evaluation.measure_speedup"
            )
    fixes = serving_fixes(launch) if in_vllm else frozenset()
    issue = (
        known_vllm_issue(local_copy(checkpoint_dir, storage_options), launch.device, fixes)
        if in_vllm and launch is not None
        else None
    )
    if issue:
        meta["known_issue"] = issue
    if fixes:  # the report says which vLLM defects were fixed while it was measured
        meta["vllm_fixes"] = sorted(fixes)
    run = evaluate_prompts(
        checkpoint_dir,
        prompts,
        target=plan.target_model,
        max_new_tokens=ev.max_new_tokens,
        stop_ids=sorted(encoder.stop_token_ids),
        min_acceptance_length=ev.min_acceptance_length,
        agreement_tolerance=ev.agreement_tolerance,
        prompt_names=names,
        in_vllm=in_vllm,
        server_factory=server_factory,
        out_dir=out,
        target_info=plan.target,
        fingerprint=plan.fingerprint,
        strict_contract=strict_contract,
        speculative_config=speculative_config,
        measure_baseline=ev.measure_speedup,
        speed_rounds=ev.speed_rounds,
        interleave=interleave,
        meta=meta,
        storage_options=storage_options,
        min_speedup=ev.min_speedup,
        must_beat=ev.must_beat,
        champion=(champion.version, str(champion.folder)) if champion else None,
        champion_margins=margins,
    )
    return run.evaluation
