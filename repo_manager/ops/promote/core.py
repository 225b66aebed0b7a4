"""`trm promote`: plan, gate, copy, compare-and-swap, record.

1. **Plan** (``plan_promotion``): which version moves where, the version it replaces, the stores, the
   gates, and the target pointer *as read now* (with its ETag). Reads only; ``--dry-run`` stops here.
   ``execute_promotion`` carries out steps 2 to 5 of exactly that plan.
2. **Gates** (``gates``): every one is run on real data (blobs downloaded and verified, a real Triton);
   any failure raises ``GateError`` with every result attached, before anything is written.
3. **Copy** (across stores only): the blobs the target lacks (server-side ``CopyObject`` when both stores
   are S3 buckets behind one endpoint, else uploaded from the verified download), then the manifests
   (If-None-Match). A reader of the target never sees a manifest without its blobs.
4. **Swap**: the target pointer is written with If-Match on the ETag read in step 1. If another writer
   changed it meanwhile, the swap is retried only when the model's entry is still the version this
   promotion replaces (someone promoted *another* model); otherwise ``ConflictError``: of two promotions
   of one model exactly one wins and the loser changes no pointer and no history. (Blobs and an identical
   manifest it may have copied are content-addressed and harmless.)
5. **Record**: one append-only history object in the target store (``history``).

A rollback is the same pipeline with the version taken from the history (the one the current version
replaced) and, by default, only the ``checksums`` gate, so it works when the server gates cannot.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repo_manager.adapters.cache import BlobCache
from repo_manager.adapters.storage import EnvPointer, Store, open_store
from repo_manager.adapters.triton.client import TritonClient
from repo_manager.adapters.triton.connect import triton_client
from repo_manager.core import config as cfg
from repo_manager.core.environments import (
    GATES,
    LatencyGate,
    LLMLatencyGate,
    ModelSpec,
    check_env_name,
    env_store,
    gate_settings,
    model_spec,
    parse_gates,
)
from repo_manager.core.errors import (
    ConflictError,
    GateError,
    InputError,
    IntegrityError,
    NotFoundError,
    Report,
    StoreNotFoundError,
    UsageError,
)
from repo_manager.core.manifest import Manifest, check_model_name
from repo_manager.core.progress import Progress, quiet
from repo_manager.core.settings import Settings
from repo_manager.ops.promote import gates as g
from repo_manager.ops.promote import history, llm
from repo_manager.ops.promote.latency import latency_gate

SWAP_RETRIES = 5




@dataclass(frozen=True)
class PromotionRequest:
    model: str
    to_env: str
    version: int | None = None
    from_env: str | None = None
    rollback: bool = False
    gates: tuple[str, ...] | None = None
    """Gates to run; ``()``: decided per version (``auto``); None: configs' ``gates.default``."""
    store: str | None = None
    """Store of both environments, overriding configs."""
    to_store: str | None = None
    """Store of the target environment only (a separate production bucket)."""
    sample: Path | None = None
    eval_command: str | None = None
    eval_threshold: float | None = None
    create_env: bool = False
    """Allow a target environment that is neither in the settings' ``environments:`` nor in the store."""
    quality_data: Path | None = None
    """The quality gate's JSON-lines file (default: the model's spec, ``quality_data``)."""


@dataclass(frozen=True)
class PromotionPlan:
    action: str
    model: str
    version: int
    to_env: str
    from_env: str | None
    source_store: str
    target_store: str
    replaces: int | None
    """The version the target environment serves now (None: the model is new there)."""
    pointer_tag: str | None
    """The target pointer's ETag as read when planning: the swap's If-Match."""
    gates: tuple[str, ...]
    config_only: bool | None
    """True when the version has exactly the files of the one it replaces (only its config differs; for an LLM,
    every file but the engine arguments, ``model.json``)."""
    skip: dict[str, str] = field(default_factory=dict)
    """Gates in ``gates`` recorded as skipped, with the reason (an LLM's agreement when its weights changed)."""

    @property
    def cross_store(self) -> bool:
        return self.source_store != self.target_store

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "model": self.model, "version": self.version, "to_env": self.to_env,
                "from_env": self.from_env, "source_store": self.source_store, "target_store": self.target_store,
                "replaces": self.replaces, "gates": list(self.gates), "config_only": self.config_only,
                "skip": dict(self.skip), "cross_store": self.cross_store}

    def describe(self) -> str:
        source = f"{self.from_env} " if self.from_env else ""
        return (f"{self.action} {self.model} version {self.version} ({source}{self.source_store}) to "
                f"{self.to_env} ({self.target_store}), replacing "
                f"{self.replaces if self.replaces is not None else 'nothing'}; gates: {', '.join(self.gates)}"
                + "".join(f"; {gate} skipped: {reason}" for gate, reason in self.skip.items()))


@dataclass(frozen=True)
class PromotionResult:
    plan: PromotionPlan
    gates: tuple[g.GateResult, ...]
    moved: bool
    blobs_copied: int = 0
    bytes_copied: int = 0
    blobs_copied_server_side: int = 0
    """Of ``blobs_copied``, those copied inside the S3 service (CopyObject) rather than uploaded."""
    record: history.HistoryRecord | None = None
    env_models: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "gates": [r.to_dict() for r in self.gates], "moved": self.moved,
                "blobs_copied": self.blobs_copied, "bytes_copied": self.bytes_copied,
                "blobs_copied_server_side": self.blobs_copied_server_side,
                "record": self.record.to_dict() if self.record else None, "env_models": self.env_models}


@dataclass(frozen=True)
class Stores:
    source: Store
    target: Store


@dataclass(frozen=True)
class PlannedPromotion:
    """A promotion decided and checked (its wave requirement included), nothing written yet: what
    ``plan_promotion`` returns and ``execute_promotion`` carries out. ``--dry-run`` prints ``plan``."""

    request: PromotionRequest
    plan: PromotionPlan
    stores: Stores

    @property
    def nothing_to_do(self) -> bool:
        """The target already serves the version: carrying it out changes and records nothing (a re-run
        pipeline job succeeds)."""
        return self.plan.replaces == self.plan.version


def open_stores(settings: Settings, request: PromotionRequest) -> Stores:
    target_location = request.to_store or env_store(settings, request.to_env, request.store)
    if request.from_env:
        source_location = env_store(settings, request.from_env, request.store)
    else:
        source_location = request.store or target_location
    target = open_store(target_location, settings)
    source = target if source_location == target_location else open_store(source_location, settings)
    return Stores(source, target)


def _read_pointer(store: Store, env: str, *, new_store_ok: bool = False) -> EnvPointer:
    """The pointer; an empty one (etag None) when the environment does not exist yet. A missing store is
    an error (exit 4 naming it) unless ``new_store_ok`` (the target of a copy, created by the copy)."""
    try:
        return store.get_env(env)
    except StoreNotFoundError:
        if not new_store_ok:
            raise
        return EnvPointer(env)
    except NotFoundError:
        return EnvPointer(env)


def check_target_env(settings: Settings, store: Store, env: str, pointer: EnvPointer, create: bool) -> None:
    """A promotion never creates an environment by accident (``--to prodution``): the target must be
    declared in the settings (``environments:``) or already exist in the store, or be asked for with
    ``--create-env``."""
    if create or pointer.etag is not None or env in settings.environments:
        return
    declared = sorted(settings.environments)
    raise NotFoundError(f"environment {env} is not declared in the settings ({settings.source}) and does not "
                        f"exist in {store.location}",
                        hint=f"{store.env_hint(env, declared)}; or pass --create-env to create it", env=env)


def _require_version(store: Store, model: str, version: int) -> None:
    """NotFoundError (exit 4) for a model or version the store does not hold, before any gate runs. A
    manifest that exists but is corrupt is left to the checksums gate to report."""
    try:
        store.get_manifest(model, version)
    except StoreNotFoundError:
        raise
    except NotFoundError as exc:
        versions = store.list_versions(model)
        if not versions:
            raise NotFoundError(f"model {model} does not exist in {store.location}",
                                hint="push it first (trm push / trm publish model --store)", model=model) from exc
        raise NotFoundError(f"model {model} has no version {version} in {store.location} (newest: {versions[-1]})",
                            model=model, version=version) from exc
    except (InputError, IntegrityError):
        pass  # a manifest that is there but corrupt or hostile: the checksums gate reports it


def _same_files(a: Manifest, b: Manifest) -> bool:
    return a.files == b.files and a.members == b.members


def _is_llm(manifest: Manifest) -> bool:
    try:
        return llm.is_llm(cfg.parse_config(manifest.config, f"manifest of {manifest.model}/{manifest.version}"))
    except InputError:
        return False  # a config that does not parse is the checksums gate's to report


def _decide(settings: Settings, request: PromotionRequest, stores: Stores) -> PromotionPlan:
    """Decide what moves where; reads the stores, writes nothing."""
    model = check_model_name(request.model)
    check_env_name(request.to_env)
    if not request.rollback:
        version = _source_version(stores.source, request, model)
        _require_version(stores.source, model, version)
    pointer = _read_pointer(stores.target, request.to_env, new_store_ok=stores.target is not stores.source)
    check_target_env(settings, stores.target, request.to_env, pointer, request.create_env)
    replaces = pointer.models.get(model)
    if request.rollback:
        if request.version is not None or request.from_env:
            raise UsageError("--rollback takes the version from the history", hint="drop --version and --from")
        if replaces is None:
            raise NotFoundError(f"environment {request.to_env} in {stores.target.location} does not serve {model}",
                                model=model, env=request.to_env)
        records = history.read(stores.target, request.to_env, model)
        version = history.previous_version(records, model, replaces)
        if version is None:
            raise NotFoundError(f"no earlier version of {model} on record in {request.to_env}'s history",
                                hint="promote the version you want explicitly with --version", model=model)
    config_only, skip = None, {}
    if replaces is not None:
        try:
            new, old = stores.source.get_manifest(model, version), stores.target.get_manifest(model, replaces)
        except (NotFoundError, InputError, IntegrityError):
            new = old = None  # a missing or corrupt manifest is the checksums gate's to report
        if new is not None and old is not None and _is_llm(new):
            config_only = llm.same_checkpoint(new, old)
            if not config_only:
                skip["agreement"] = llm.weights_changed_reason(new, old)
        elif new is not None and old is not None:
            config_only = _same_files(new, old)
    gates = _choose_gates(settings, request, replaces, config_only, llm_weights_changed=bool(skip))
    if request.gates or (request.gates is None and parse_gates(None, settings)):
        skip = {}  # named gates (options or configs) run as asked: agreement then compares other weights too
    return PromotionPlan("rollback" if request.rollback else "promote", model, version, request.to_env,
                         request.from_env, stores.source.location, stores.target.location, replaces,
                         pointer.etag, gates, config_only, {k: v for k, v in skip.items() if k in gates})


def _source_version(store: Store, request: PromotionRequest, model: str) -> int:
    if request.from_env is None:
        if request.version is None:
            raise UsageError("say which version to promote", hint="pass --version N, or --from ENV")
        return request.version
    source = store.get_env(request.from_env)  # NotFoundError (with close names) for a mistyped --from
    served = source.models.get(model)
    if served is None:
        raise NotFoundError(f"environment {request.from_env} in {store.location} does not serve {model}",
                            hint="point it at a version first (trm promote --to it)", model=model)
    if request.version is None or request.version == served:
        return served
    # an explicit earlier version is accepted when it passed through the source environment (on its record):
    # e.g. two releases of one model racing for production while staging already moved on
    if any(r.to_version == request.version for r in history.read(store, request.from_env, model)):
        return request.version
    raise InputError(f"{request.from_env} serves {model} version {served}, not {request.version}, and never "
                     "served it on record", hint=f"promote what {request.from_env} serves, or drop --from",
                     model=model)


def _choose_gates(settings: Settings, request: PromotionRequest, replaces: int | None,
                  config_only: bool | None, llm_weights_changed: bool = False) -> tuple[str, ...]:
    # None: configs' gates.default (not for rollbacks); () : auto, also when given as --gates auto
    selected = parse_gates(None, settings) if request.gates is None and not request.rollback else request.gates
    if selected:
        chosen = set(selected)
    elif request.rollback:
        chosen = {"checksums"}
    else:
        chosen = {"checksums", "load"}
        if replaces is not None:
            chosen.add("latency")
            if config_only or llm_weights_changed:  # the latter recorded as skipped, with the reason
                chosen.add("agreement")
            elif request.eval_command or model_spec(settings, request.model).eval_command:
                chosen.add("eval")
            if not config_only and (request.quality_data or model_spec(settings, request.model).quality_data):
                chosen.add("quality")
    chosen.add("checksums")  # the other gates load the files it verified
    return tuple(name for name in GATES if name in chosen)


# ---------------------------------------------------------------------------------------- execution
def run_gates(settings: Settings, request: PromotionRequest, plan: PromotionPlan, stores: Stores,
              cache: BlobCache, progress: Progress) -> tuple[list[g.GateResult], g.FetchedVersion | None]:
    progress(f"checksums: verifying every blob of {plan.model}/{plan.version} in {plan.source_store}")
    result, fetched = g.checksums_gate(stores.source, cache, plan.model, plan.version)
    results = [result]
    if fetched is None:
        return results, None
    server_gates = [name for name in plan.gates if name != "checksums"]
    if not server_gates:
        return results, fetched
    spec = model_spec(settings, plan.model)
    sample = request.sample or spec.sample
    baseline: g.FetchedVersion | None = None
    if plan.replaces is not None and any(n in server_gates for n in ("latency", "agreement", "quality", "eval")):
        try:
            baseline = g.fetch_version(stores.target, cache, plan.model, plan.replaces)
        except (NotFoundError, InputError, IntegrityError) as exc:  # access denied, network: the store's error
            return results + [g.GateResult(n, False, f"the replaced version {plan.replaces} cannot be read: "
                                                     f"{exc.message}") for n in server_gates], fetched
    quality: g.QualityCheck | g.GateResult | None = None
    if "quality" in server_gates and not llm.is_llm(fetched.config):  # bad data: before a server starts
        data = request.quality_data or spec.quality_data
        origin = "--quality-data" if request.quality_data else f"quality_data of the model spec {plan.model}"
        quality = g.quality_check(fetched, baseline, data, origin, settings.quality, settings.source)
    with _gate_server(settings, fetched, baseline, progress=progress) as (client, repository):
        embedded = repository is not None or not settings.triton_url
        if llm.is_llm(fetched.config):  # each version loaded once for all its gates (engine starts are slow)
            params = _latency_params(settings, spec, "llm_latency")
            llm_results = llm.run_llm_gates(
                client, server_gates, fetched, baseline, plan.skip, params, sample, progress,
                lambda names: g.run_eval(client.url, names, fetched, baseline, *_eval_settings(request, spec)),
                repository)
            results += [_without_address(r, client.url) if embedded else r for r in llm_results]
            return results, fetched
        for name in server_gates:
            progress(f"{name}: {plan.model}/{plan.version} on {client.url}")
            result = _server_gate(name, client, repository, fetched, baseline, settings, request, spec, sample,
                                  progress, quality)
            results.append(_without_address(result, client.url) if embedded else result)
    return results, fetched


def _without_address(result: g.GateResult, url: str) -> g.GateResult:
    """The record names an embedded server as such: its address stops existing with the promotion."""
    def clean(value: Any) -> Any:
        if isinstance(value, str):
            for before, after in ((f"Triton at {url}", "the embedded Triton"), (f"on {url}", "on the embedded Triton")):
                value = value.replace(before, after)
            return value.replace(url, "the embedded Triton")
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return dataclasses.replace(result, summary=clean(result.summary), details=clean(result.details))


@contextmanager
def _gate_server(settings: Settings, *versions: g.FetchedVersion | None,
                 progress: Progress = quiet) -> Iterator[tuple[TritonClient, Path | None]]:
    """(client, the server's repository folder or None). An ensemble loads its members from the server's own
    repository folder, which file overrides cannot fill, so versions holding one are gated on an embedded
    server whose repository is a scratch folder, even when --url is given (as publish verifies them)."""
    if not any(c.config.HasField("ensemble_scheduling") for v in versions if v for c in v.candidates):
        with triton_client(settings) as client:
            yield client, None
        return
    if settings.triton_url:
        progress("an ensemble is gated on an embedded server (Triton loads its members from its own repository "
                 "folder)")
    with tempfile.TemporaryDirectory(prefix="trm-gates-") as scratch, \
            triton_client(dataclasses.replace(settings, triton_url=None), repository=Path(scratch)) as client:
        yield client, Path(scratch)


def _server_gate(name: str, client, repository: Path | None, fetched: g.FetchedVersion,
                 baseline: g.FetchedVersion | None, settings: Settings, request: PromotionRequest, spec,
                 sample: Path | None, progress: Progress,
                 quality: g.QualityCheck | g.GateResult | None = None) -> g.GateResult:
    if name == "quality" and isinstance(quality, g.GateResult):
        return quality
    if name == "load":
        return g.load_gate(client, fetched, repository)
    if name == "eval":
        return g.eval_gate(client, fetched, baseline, *_eval_settings(request, spec), repository=repository)
    if baseline is None:
        return g.skipped(name, "the target environment serves no earlier version to compare with")
    if name == "latency":
        params = _latency_params(settings, spec, "latency")
        return latency_gate(client, fetched, baseline, params, sample, progress, repository)
    if name == "quality" and isinstance(quality, g.QualityCheck):
        return g.quality_gate(client, fetched, baseline, quality, repository)
    return g.agreement_gate(client, fetched, baseline, sample, repository)


def _eval_settings(request: PromotionRequest, spec) -> tuple[str, float]:
    command = request.eval_command or spec.eval_command
    threshold = request.eval_threshold if request.eval_threshold is not None else spec.eval_threshold
    if not command or threshold is None:
        raise UsageError("the eval gate needs a command and a threshold",
                         hint="pass --eval-cmd and --eval-threshold, or set eval in configs/models/NAME.yaml")
    return command, threshold


def _latency_params(settings: Settings, spec: ModelSpec, key: str) -> LatencyGate | LLMLatencyGate:
    """gates.latency (or gates.llm_latency for an LLM), at the spec's peak rate when it names one."""
    params = getattr(gate_settings(settings), key)
    return dataclasses.replace(params, rate=float(spec.slo["peak_rps"])) if spec.slo.get("peak_rps") else params


def copy_version(source: Store, target: Store, fetched: g.FetchedVersion,
                 cache: BlobCache) -> tuple[int, int, int]:
    """Blobs the target lacks, then manifests (members first). Returns (blobs, bytes, blobs copied
    server-side) copied."""
    count = size = server_side = 0
    manifests = fetched.manifests
    for manifest in manifests:
        for entry in manifest.files:
            if target.has_blob(entry.sha256):
                continue
            # the cache holds the bytes verified against the manifest: uploaded from there unless copied inside
            # the service
            server_side += target.copy_blob(source, entry.sha256, entry.size, local=cache.path(entry.sha256))
            count += 1
            size += entry.size
    for manifest in manifests:
        try:
            target.put_manifest(manifest)
        except ConflictError as exc:
            if target.get_manifest(manifest.model, manifest.version).to_json() != manifest.to_json():
                raise ConflictError(f"{target.location} holds a different version {manifest.version} of "
                                    f"{manifest.model}", hint="versions are immutable: publish a new one",
                                    model=manifest.model) from exc
    return count, size, server_side


def swap(target: Store, plan: PromotionPlan) -> EnvPointer:
    """Compare-and-swap the target pointer (see the module docstring for the retry rule)."""
    pointer = _read_pointer(target, plan.to_env)
    for _ in range(SWAP_RETRIES):
        now = pointer.models.get(plan.model)
        if pointer.etag != plan.pointer_tag and now != plan.replaces:
            raise ConflictError(f"another promotion won: {plan.to_env} now serves {plan.model} version {now}, "
                                f"not {plan.replaces} as when this promotion started; nothing was changed",
                                hint="check `trm history` and promote again if still wanted",
                                model=plan.model, env=plan.to_env)
        updated = pointer.with_models({plan.model: plan.version})
        try:
            tag = target.put_env(updated)
            return EnvPointer(updated.name, updated.models, updated.updated_at, tag)
        except ConflictError:
            pointer = _read_pointer(target, plan.to_env)
    raise ConflictError(f"environment {plan.to_env} kept changing; gave up after {SWAP_RETRIES} tries",
                        hint="promote again", env=plan.to_env)


def plan_promotion(settings: Settings, request: PromotionRequest, *, progress: Progress = quiet) -> PlannedPromotion:
    """Decide one promotion or rollback and check that its wave allows it; reads the stores, writes nothing."""
    stores = open_stores(settings, request)
    plan = _decide(settings, request, stores)
    planned = PlannedPromotion(request, plan, stores)
    if planned.nothing_to_do:
        progress(f"{plan.to_env} already serves {plan.model} version {plan.version}; nothing to do")
        return planned
    from repo_manager.ops.promote.waves import check_wave  # noqa: PLC0415 - waves imports this package

    check_wave(settings, plan.model, plan.version, plan.to_env, store=request.store,
               rollback=plan.action == "rollback")
    progress(plan.describe())
    return planned


def execute_promotion(settings: Settings, planned: PlannedPromotion, *, progress: Progress = quiet,
                      environ: dict[str, str] | None = None) -> PromotionResult:
    """Gate, copy, swap and record what ``planned`` says. A promotion with nothing to do only reads the
    pointer (its result says what the target serves) and moves nothing."""
    request, plan, stores = planned.request, planned.plan, planned.stores
    if planned.nothing_to_do:
        return PromotionResult(plan, (), False, env_models=_read_pointer(stores.target, plan.to_env).models)
    with tempfile.TemporaryDirectory(prefix="trm-promote-") as scratch:
        cache = BlobCache(scratch)
        results, fetched = run_gates(settings, request, plan, stores, cache, progress)
        if fetched is None or any(not r.passed for r in results):
            _blocked(plan, results)
        copied = (0, 0, 0)
        if plan.cross_store:
            progress(f"copying {plan.model}/{plan.version} into {plan.target_store}")
            copied = copy_version(stores.source, stores.target, fetched, cache)
            # what the target will serve is the target's copy: blobs it already held (written by anyone) and
            # the ones just copied are downloaded and verified again before the pointer moves
            progress(f"copy: verifying every blob of {plan.model}/{plan.version} in {plan.target_store}")
            check, _ = g.checksums_gate(stores.target, BlobCache(Path(scratch) / "target"), plan.model, plan.version)
            results.append(g.GateResult("copy", check.passed, check.summary, check.details, check.seconds))
            if not check.passed:
                _blocked(plan, results)
    pointer = swap(stores.target, plan)
    progress(f"{plan.to_env} now serves {plan.model} version {plan.version}")
    record = history.append(stores.target, history.HistoryRecord(
        env=plan.to_env, model=plan.model, action=plan.action, from_version=plan.replaces, to_version=plan.version,
        store=plan.target_store, source_env=plan.from_env, source_store=plan.source_store,
        gates=tuple(r.to_dict() for r in results), pipeline=history.pipeline_context(environ),
        pointer_tag=pointer.etag or ""))
    return PromotionResult(plan, tuple(results), True, *copied, record=record, env_models=dict(pointer.models))


def _blocked(plan: PromotionPlan, results: list[g.GateResult]) -> None:
    """Raise GateError with every gate's result attached (``error.report``: printed by the CLI)."""
    failed = [r for r in results if not r.passed]
    blocked = PromotionResult(plan, tuple(results), moved=False)
    raise GateError(f"promotion of {plan.model} version {plan.version} to {plan.to_env} blocked by gate(s) "
                    f"{', '.join(r.name for r in failed)}: {failed[0].summary}",
                    hint="fix the version and publish a new one; see the gate results (--json)",
                    report=Report(blocked.to_dict(), None, blocked), model=plan.model, version=plan.version,
                    env=plan.to_env)


def promote(settings: Settings, request: PromotionRequest, *, progress: Progress = quiet) -> PromotionResult:
    """Plan and carry out one promotion or rollback."""
    return execute_promotion(settings, plan_promotion(settings, request, progress=progress), progress=progress)


@dataclass(frozen=True)
class HistoryView:
    store: str
    records: list[history.HistoryRecord]
    unrecorded: dict[str, dict[str, int | None]]
    """Models whose pointer entry is not what their last record says: moved outside `trm promote` (e.g.
    `trm push --env`), or a promotion that died between its swap and its record."""

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "records": [r.to_dict() for r in self.records], "unrecorded": self.unrecorded}


def read_history(settings: Settings, env: str, model: str | None = None, store: str | None = None) -> HistoryView:
    target = open_store(env_store(settings, env, store), settings)
    if model is not None:
        check_model_name(model)
    records = history.read(target, env, model)
    last = {r.model: r.to_version for r in records}
    pointer = _read_pointer(target, env)
    if pointer.etag is None and not records and env not in settings.environments:
        raise NotFoundError(f"environment {env} does not exist in {target.location}",
                            hint=target.env_hint(env, sorted(settings.environments)), env=env)
    served = pointer.models
    unrecorded = {m: {"serving": served.get(m), "last_recorded": last.get(m)}
                  for m in sorted(set(served) | set(last)) if (model is None or m == model)
                  and served.get(m) != last.get(m)}
    return HistoryView(target.location, records, unrecorded)
