"""Read-only views of the repository for people and pipelines: list, show, diff, validate.

Every view is plain data (JSON-friendly dicts): the CLI prints it with ``--json`` and draws tables from it
otherwise. Which environments serve which version is read from the stores the settings name (each
environment's store, and the default store's environments); without a store the views leave it out.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from repo_manager.adapters.repository import LocalRepository
from repo_manager.adapters.storage import open_store
from repo_manager.core import config as cfg
from repo_manager.core.environments import env_store
from repo_manager.core.errors import IntegrityError, TrmError, UsageError
from repo_manager.core.manifest import (
    MAX_RECORD_ITEMS,
    MAX_RECORD_TEXT,
    Manifest,
    read_config,
    read_tuning,
    read_verification,
)
from repo_manager.core.settings import Settings

if TYPE_CHECKING:
    from repo_manager.ops.promote.core import PlannedPromotion

# ------------------------------------------------------------------------------------ one version

REFERENCES = {"onnx": "onnxruntime", "huggingface": "PyTorch", "python": "declared outputs",
              "tensorrt-llm": "TensorRT-LLM"}


def verification_summary(manifest: Manifest) -> dict[str, Any]:
    """Verified or not, against what, and the worst difference seen (or why it was not verified). A record
    trm cannot read (a value of the wrong type) leaves the version unverified, and says why."""
    try:
        record = read_verification(manifest)
    except IntegrityError as exc:
        return {"verified": False, "reason": exc.message, "text": "no: its verification record is malformed",
                "short": "no (bad record)"}
    source = manifest.source or {}
    if not record.present:
        return {"verified": False, "reason": "no verification record", "text": "no record", "short": "no record"}
    if record.skipped:
        reason = record.skipped if record.skipped != "--no-verify" else "skipped (--no-verify)"
        return {"verified": False, "reason": reason, "text": f"no: {reason}", "short": "no (skipped)"}
    if not record.passed:
        return {"verified": False, "reason": "verification did not pass", "text": "no: did not pass",
                "short": "no (failed)"}
    if source.get("kind") == "tuning":
        reference = f"version {plain(source.get('from_version'))} (same files, tuned)"
    else:
        reference = record.reference or REFERENCES.get(str(source.get("kind")), "the source")
    worst_values = [diff for _, diff in record.worst_abs_diff]
    cosines = [cosine for _, cosine in record.cosines]
    summary: dict[str, Any] = {"verified": True, "reference": reference, "samples": record.samples,
                               "worst_abs_diff": max(worst_values) if worst_values else None,
                               "min_cosine": min(cosines) if cosines else None}
    detail = (f"worst diff {summary['worst_abs_diff']:.2g}" if worst_values else
              f"cosine >= {summary['min_cosine']:.6f}" if cosines else "")
    summary["text"] = f"yes vs {reference}" + (f", {detail}" if detail else "")
    summary["short"] = "yes"
    return summary


def verification_details(manifest: Manifest) -> list[str]:
    """Per output and per case: the worst difference and lowest cosine of the verification (empty when the
    record has none, or cannot be read)."""
    try:
        record = read_verification(manifest)
    except IntegrityError:
        return []
    return [f"{out}: worst abs diff {diff:.3g}" for out, diff in record.worst_abs_diff] + \
        [f"{case}: cosine {cosine:.6f}" for case, cosine in record.cosines]


def quality_details(manifest: Manifest) -> str | None:
    """A text version's precision and its quality gate on the user's data (both in its source record), in one
    line (None: neither is recorded). Only well-typed figures are shown: a record is a document from a store."""
    record = manifest.source if isinstance(manifest.source, dict) else {}
    precision = record.get("precision")
    gate = record.get("quality") if isinstance(record.get("quality"), dict) else None
    if not isinstance(precision, str) and gate is None:
        return None
    text = f"precision {plain(precision)}" if isinstance(precision, str) else "precision not recorded"
    if gate is None:
        return text + "; no quality gate (publish with --eval-data FILE)"
    data = gate.get("data") if isinstance(gate.get("data"), dict) else {}
    figures = gate.get("figures") if isinstance(gate.get("figures"), dict) else {}
    shown = ", ".join(f"{plain(k).replace('_', ' ')} {v:g}" for k, v in list(figures.items())[:MAX_RECORD_ITEMS]
                      if isinstance(v, int | float) and not isinstance(v, bool))
    digest = data.get("sha256") if isinstance(data.get("sha256"), str) else ""
    tried = [t for t in gate.get("tried", []) if isinstance(t, dict)] if isinstance(gate.get("tried"), list) else []
    recipe = (f"; int8 recipe {plain(tried[-1].get('recipe'))}"
              + (f" after {', '.join(plain(t.get('recipe')) for t in tried[:-1][:MAX_RECORD_ITEMS])} missed"
                 if len(tried) > 1 else "")) if tried else ""
    return (f"{text}; quality gate on {plain(data.get('file'))} ({plain(data.get('items'))} items, sha256 "
            f"{plain(digest[:12])}): {shown or 'no figures'}: "
            + ("passed" if gate.get("passed") is True else "not passed") + recipe)


_ALLOWANCES = {"prompt_text_in_output": "prompt tail in text: {} chars",
               "incomplete_utf8_tokens_withheld": "incomplete character held back: {} tokens",
               "worst_margin_nats": "worst margin {} nats", "equal_prefix": "equal prefix {} tokens"}


def engine_details(manifest: Manifest) -> dict[str, Any] | None:
    """An LLM version's engine arguments (a vLLM model.json as published, less the folder it names) and the
    memory plan that chose them; None for a version whose source records no engine arguments."""
    plan = manifest.source.get("plan") if isinstance(manifest.source, dict) else None
    if not isinstance(plan, dict) or not isinstance(plan.get("engine_args"), dict):
        return None
    memory = plan.get("memory") if isinstance(plan.get("memory"), dict) else {}
    steps = memory.get("steps") if isinstance(memory.get("steps"), list) else []
    kv = plan.get("kv_cache_bytes")
    args = list(plan["engine_args"].items())[:MAX_RECORD_ITEMS]
    return {"engine_args": {str(k)[:MAX_RECORD_TEXT]: v for k, v in args
                            if isinstance(v, int | float | bool) or isinstance(v, str) and len(v) <= MAX_RECORD_TEXT},
            "device": plan.get("device") if isinstance(plan.get("device"), str) else None,
            "kv_cache_bytes": kv if isinstance(kv, int) and not isinstance(kv, bool) else None,
            "reason": memory["reason"][:MAX_RECORD_TEXT] if isinstance(memory.get("reason"), str) else None,
            "steps": [step[:MAX_RECORD_TEXT] for step in steps[:MAX_RECORD_ITEMS] if isinstance(step, str)]}


def generation_cases(manifest: Manifest) -> list[dict[str, Any]]:
    """The cases of an LLM version's verification (prompt, tokens, answers, what was allowed), one row each;
    empty for any other record."""
    record = manifest.verification if isinstance(manifest.verification, dict) else {}
    cases = record.get("cases") if isinstance(record.get("cases"), list) else []
    rows = []
    for case in cases[:MAX_RECORD_ITEMS]:
        if not isinstance(case, dict) or not isinstance(case.get("case"), str):
            continue
        if isinstance(case.get("refused"), str):
            rows.append({"case": case["case"][:MAX_RECORD_TEXT],
                         "result": f"refused: {case['refused'][:MAX_RECORD_TEXT]}"})
        elif "prompt_tokens" in case:
            numbers = {k: case.get(k) for k in ("prompt_tokens", "tokens", "responses")}
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers.values()):
                continue
            notes = [text.format(case[key]) for key, text in _ALLOWANCES.items()
                     if isinstance(case.get(key), int | float) and not isinstance(case.get(key), bool)]
            rows.append({"case": case["case"][:MAX_RECORD_TEXT], **numbers,
                         "result": "; ".join(notes) if notes else "token ids equal" if case.get("equal") else "passed"})
    return rows


def tuning_summary(manifest: Manifest) -> dict[str, Any] | None:
    """The SLO and the settings tune-batching chose (None: the version was not tuned)."""
    try:
        record = read_tuning(manifest)
    except IntegrityError as exc:
        return {"slo": {}, "chosen": {}, "tuned_from_version": None, "malformed": exc.message,
                "text": "tuning record malformed", "evidence": []}
    if record is None:
        return None
    slo_text = " ".join(x for x in (
        f"p99 {record.p99_ms:g} ms" if record.p99_ms is not None else "",
        f"at {record.low_rps:g}-{record.peak_rps:g} rps" if record.low_rps is not None
        and record.peak_rps is not None else "") if x)
    chosen, settings = record.chosen, ""
    if chosen:
        settings = ", ".join(x for x in (
            f"batch {chosen.get('max_batch_size', '?')} x{chosen.get('instances', 1)}",
            (f"delay {chosen.get('max_queue_delay_microseconds', 0)} us" if chosen.get("dynamic_batching")
             else "no dynamic batching"),
            f"preferred {chosen['preferred_batch_size']}" if chosen.get("preferred_batch_size") else "",
            (f"queue timeout {chosen['default_timeout_microseconds']} us then reject"
             if chosen.get("default_timeout_microseconds") else ""),
            f"max queue {chosen['max_queue_size']}" if chosen.get("max_queue_size") else "") if x)
    return {**record.summary(), "text": ": ".join(p for p in (slo_text, settings) if p) or "tuned",
            "evidence": [f"{setting}: {why}" for setting, why in record.evidence]}


def plain(value: Any, limit: int = 200) -> str:
    """Any JSON value as a person reads it (no Python reprs: ``a, b`` for a list, ``k: v`` for a mapping,
    ``-`` for null), at most ``limit`` characters."""
    if value is None:
        text = "-"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, dict):
        text = ", ".join(f"{k}: {plain(v, limit)}" for k, v in list(value.items())[:50])
    elif isinstance(value, list | tuple):
        text = ", ".join(plain(v, limit) for v in value[:50])
    else:
        text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def source_text(source: dict[str, Any]) -> str:
    kind = plain(source.get("kind") or "?")
    if kind == "tuning":
        return f"tuning of version {plain(source.get('from_version'))}"
    where = source.get("path") or source.get("repo_id") or source.get("example") or ""
    return f"{kind} {plain(where)}".strip()


def members_bytes(repo: LocalRepository, manifest: Manifest) -> int | None:
    """Bytes of the member versions an ensemble version pins (None: not an ensemble, or a member is missing
    from this repository)."""
    if not manifest.members:
        return None
    try:
        return sum(repo.manifest(m, v).total_size for m, v in manifest.members.items())
    except TrmError:
        return None


def version_row(manifest: Manifest, envs: dict[str, dict[str, int]] | None = None,
                repo: LocalRepository | None = None) -> dict[str, Any]:
    serving = sorted(env for env, models in (envs or {}).items() if models.get(manifest.model) == manifest.version)
    members = members_bytes(repo, manifest) if repo is not None else None
    return {"version": manifest.version, "created_at": manifest.created_at, "source": manifest.source,
            "source_text": source_text(manifest.source), "files": len(manifest.files), "bytes": manifest.total_size,
            "bytes_with_members": manifest.total_size + members if members is not None else None,
            "verification": verification_summary(manifest), "tuning": tuning_summary(manifest),
            "members": manifest.members, "environments": serving}


def size_text(row: dict[str, Any]) -> str:
    """A version's size; an ensemble's with the members it pins."""
    if row.get("bytes_with_members") is not None:
        return f"{human_size(row['bytes_with_members'])} (with members)"
    return human_size(row["bytes"])


def human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


# ------------------------------------------------------------------------------------ environments

def environment_pointers(settings: Settings, store: str | None = None) -> dict[str, Any]:
    """``{"environments": {env: {model: version}}, "stores": {env: location}, "notes": [...]}``.

    With ``store``: every environment in that store. Otherwise each configured environment in its store,
    plus the environments found in the default store. Nothing configured: empty. An unreadable store is a
    note, not an error (a listing should still show the local repository).
    """

    wanted: dict[str, str | None] = {}
    notes: list[str] = []
    defaults = [store] if store else [settings.store] if settings.store else []
    for location in defaults:
        try:
            wanted.update({env: location for env in open_store(location, settings).list_envs()})
        except TrmError as exc:
            notes.append(f"{location}: {exc.message}")
    if not store:
        for env in settings.environments:
            try:
                wanted.setdefault(env, env_store(settings, env))
            except UsageError:  # declared without a store, and no default store: nothing to show, not a fault
                continue
            except TrmError as exc:
                notes.append(f"environment {env}: {exc.message}")
    opened: dict[str, Any] = {}
    pointers: dict[str, dict[str, int]] = {}
    for env, location in sorted(wanted.items()):
        try:
            if location not in opened:
                opened[location] = open_store(location, settings)
            pointers[env] = dict(opened[location].get_env(env).models)
        except TrmError as exc:
            notes.append(f"environment {env} ({location}): {exc.message}")
    return {"environments": pointers, "stores": {e: wanted[e] for e in pointers}, "notes": notes}


def _envs_or_none(settings: Settings | None, store: str | None) -> dict[str, Any] | None:
    """The environments to show, or None when no store is configured for any of them (the views then
    leave the environments column out, rather than show it empty)."""
    if settings is None or not (store or settings.store or settings.environments):
        return None
    envs = environment_pointers(settings, store)
    if not (store or settings.store or envs["environments"] or envs["notes"]):
        return None
    return envs


# ------------------------------------------------------------------------------------ list / show

def list_models(root: str | Path, settings: Settings | None = None, *, store: str | None = None,
                all_versions: bool = False) -> dict[str, Any]:
    """One row per model (the latest version's facts), or per version with ``all_versions``."""
    repo = LocalRepository(root)
    envs = _envs_or_none(settings, store)
    pointers = envs["environments"] if envs else {}
    rows, unreadable = [], []
    for model in repo.models():
        versions = repo.versions(model)
        row: dict[str, Any] = {"model": model, "versions": versions, "latest": versions[-1] if versions else None}
        if versions:
            try:
                manifests = [repo.manifest(model, v) for v in (versions if all_versions else versions[-1:])]
                latest = manifests[-1]
                row["backend"] = backend_name(read_config(latest))
            except TrmError as exc:  # one unreadable manifest hides neither the model nor the others
                row["unreadable"] = exc.message
                unreadable.append(f"{model}: {exc.message.splitlines()[0]}")
            else:
                row.update({k: v for k, v in version_row(latest, pointers, repo).items() if k != "version"})
                if all_versions:
                    row["all"] = [version_row(m, pointers, repo) for m in manifests]
        if envs is not None:
            row["served"] = {env: models[model] for env, models in pointers.items() if model in models}
        rows.append(row)
    result: dict[str, Any] = {"repository": str(root), "models": rows, "unreadable": unreadable}
    if envs is not None:
        result["stores"], result["notes"] = envs["stores"], envs["notes"]
    return result


def backend_name(config: cfg.ModelConfig) -> str:
    return config.backend or config.platform or "?"


def config_essentials(config: cfg.ModelConfig, members: dict[str, int]) -> dict[str, Any]:
    """What matters per backend: an ensemble's steps with their pinned members; otherwise batching,
    instances, tensors, warmup and parameters (no empty fields)."""
    inputs, outputs = cfg.tensor_specs(config)
    essentials: dict[str, Any] = {"backend": backend_name(config), "max_batch_size": config.max_batch_size,
                                  "inputs": [f"{t.name} {t.dtype} {list(t.dims)}" for t in inputs],
                                  "outputs": [f"{t.name} {t.dtype} {list(t.dims)}" for t in outputs]}
    if config.HasField("ensemble_scheduling"):
        essentials["steps"] = [
            {"model": s.model_name,
             "version": s.model_version if s.model_version > 0 else members.get(s.model_name, "latest"),
             "inputs": dict(s.input_map), "outputs": dict(s.output_map)}
            for s in config.ensemble_scheduling.step]
        return essentials
    summary = cfg.summarize(config)
    if summary["instances"]:
        essentials["instances"] = summary["instances"]
    if summary["dynamic_batching"] is not None:
        essentials["dynamic_batching"] = {k: v for k, v in summary["dynamic_batching"].items() if v != []}
    if config.model_warmup:
        essentials["warmup"] = [w.name for w in config.model_warmup]
    if config.parameters:
        essentials["parameters"] = {k: v.string_value for k, v in sorted(config.parameters.items())}
    return essentials


def show_model(root: str | Path, name: str, version: int | None = None, settings: Settings | None = None, *,
               store: str | None = None) -> dict[str, Any]:
    repo = LocalRepository(root)
    config = repo.config(name)
    manifest = repo.manifest(name, version)
    envs = _envs_or_none(settings, store)
    pointers = envs["environments"] if envs else {}
    versions = repo.versions(name)
    shown_config = read_config(manifest)
    result: dict[str, Any] = {
        "model": name,
        "versions": versions,
        "config": cfg.summarize(config),
        "manifest": {
            "version": manifest.version, "created_at": manifest.created_at, "files": len(manifest.files),
            "bytes": manifest.total_size, "source": manifest.source, "environment": manifest.environment,
            "verification": manifest.verification, "members": manifest.members,
            "tuning": manifest.tuning, "config": cfg.summarize(shown_config),
        },
        "version_rows": [version_row(repo.manifest(name, v), pointers, repo) for v in versions],
        "essentials": config_essentials(shown_config, manifest.members),
        "verification_details": verification_details(manifest),
        "quality": quality_details(manifest),
        "engine": engine_details(manifest),
        "generation_cases": generation_cases(manifest),
        "tuning_evidence": (tuning_summary(manifest) or {}).get("evidence", []),
    }
    if envs is not None:
        result["served"] = {env: models[name] for env, models in pointers.items() if name in models}
        result["stores"], result["notes"] = envs["stores"], envs["notes"]
    return result


# ------------------------------------------------------------------------------------ diff

def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
    return value


def _as_json(field: FieldDescriptor, value: Any) -> Any:
    if isinstance(value, Message):
        return json_format.MessageToDict(value, preserving_proto_field_name=True)
    return _scalar(field, value)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _is_repeated(field: FieldDescriptor) -> bool:
    # FieldDescriptor.label is deprecated in newer protobuf releases; is_repeated replaces it
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def proto_diff(a: Message, b: Message, prefix: str = "") -> list[dict[str, Any]]:
    """Field-by-field differences between two messages of one type, walking the schema: nested messages
    by field, repeated messages by their ``name`` when they have one (inputs, outputs), else by position,
    maps by key. Each change: ``{"field": path, "a": value or None, "b": value or None}``."""
    changes: list[dict[str, Any]] = []
    for field in a.DESCRIPTOR.fields:
        path = f"{prefix}{field.name}"
        va, vb = getattr(a, field.name), getattr(b, field.name)
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]
            for key in sorted(set(va) | set(vb), key=str):
                sub = f"{path}[{key}]"
                if key not in va or key not in vb:
                    changes.append({"field": sub, "a": _as_json(value_field, va[key]) if key in va else None,
                                    "b": _as_json(value_field, vb[key]) if key in vb else None})
                elif value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    changes += proto_diff(va[key], vb[key], sub + ".")
                elif va[key] != vb[key]:
                    changes.append({"field": sub, "a": va[key], "b": vb[key]})
        elif _is_repeated(field) and field.type == FieldDescriptor.TYPE_MESSAGE:
            changes += _repeated_diff(field, list(va), list(vb), path)
        elif _is_repeated(field):
            if list(va) != list(vb):
                changes.append({"field": path, "a": [_scalar(field, x) for x in va],
                                "b": [_scalar(field, x) for x in vb]})
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            present_a, present_b = a.HasField(field.name), b.HasField(field.name)
            if present_a != present_b and not (va.ListFields() or vb.ListFields()):
                changes.append({"field": path, "a": {} if present_a else None, "b": {} if present_b else None})
            elif present_a or present_b:
                changes += proto_diff(va, vb, path + ".")
        elif va != vb:
            changes.append({"field": path, "a": _scalar(field, va), "b": _scalar(field, vb)})
    return changes


def _repeated_diff(field: FieldDescriptor, va: list, vb: list, path: str) -> list[dict[str, Any]]:
    keyed = "name" in field.message_type.fields_by_name and all(
        x.name for x in va + vb) and len({x.name for x in va}) == len(va) and len({x.name for x in vb}) == len(vb)
    if keyed:
        left, right = {x.name: x for x in va}, {x.name: x for x in vb}
        keys = [x.name for x in va] + [x.name for x in vb if x.name not in left]
    else:
        left, right = dict(enumerate(va)), dict(enumerate(vb))
        keys = list(range(max(len(va), len(vb))))
    changes: list[dict[str, Any]] = []
    for key in keys:
        sub = f"{path}[{key}]"
        if key in left and key in right:
            changes += proto_diff(left[key], right[key], sub + ".")
        else:
            changes.append({"field": sub, "a": _as_json(field, left[key]) if key in left else None,
                            "b": _as_json(field, right[key]) if key in right else None})
    return changes


def _dict_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    changes: list[dict[str, Any]] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict | None) and isinstance(vb, dict | None) and (va or vb):
            changes += _dict_diff(va or {}, vb or {}, f"{prefix}{key}.")
        elif va != vb:
            changes.append({"field": f"{prefix}{key}", "a": va, "b": vb})
    return changes


def diff_manifests(a: Manifest, b: Manifest) -> dict[str, Any]:
    """What changed from version ``a`` to version ``b`` (of one model): config fields through Triton's
    schema, files by sha256, ensemble members, source, verification, tuning, build environment."""
    files_a, files_b = {f.path: f for f in a.files}, {f.path: f for f in b.files}
    files = {
        "added": [{"path": p, "size": files_b[p].size, "sha256": files_b[p].sha256}
                  for p in sorted(set(files_b) - set(files_a))],
        "removed": [{"path": p, "size": files_a[p].size, "sha256": files_a[p].sha256}
                    for p in sorted(set(files_a) - set(files_b))],
        "changed": [{"path": p, "a_size": files_a[p].size, "b_size": files_b[p].size,
                     "a_sha256": files_a[p].sha256, "b_sha256": files_b[p].sha256}
                    for p in sorted(set(files_a) & set(files_b)) if files_a[p].sha256 != files_b[p].sha256],
        "unchanged": sum(1 for p in set(files_a) & set(files_b) if files_a[p].sha256 == files_b[p].sha256),
        "bytes": {"a": a.total_size, "b": b.total_size},
    }
    config_changes = proto_diff(read_config(a), read_config(b))
    ver_a, ver_b = verification_summary(a), verification_summary(b)
    tune_a, tune_b = tuning_summary(a), tuning_summary(b)
    compared = ("slo", "chosen", "tuned_from_version")
    tuning = _dict_diff({k: v for k, v in (tune_a or {}).items() if k in compared},
                        {k: v for k, v in (tune_b or {}).items() if k in compared})
    engine_a, engine_b = engine_details(a), engine_details(b)
    result = {
        "model": a.model, "a": a.version, "b": b.version,
        "config": config_changes,
        "files": files,
        "members": _dict_diff(a.members, b.members),
        "engine": _dict_diff((engine_a or {}).get("engine_args", {}), (engine_b or {}).get("engine_args", {})),
        "source": [c for c in _dict_diff(a.source, b.source) if not c["field"].startswith("plan.engine_args.")],
        "verification": {"a": ver_a, "b": ver_b} if ver_a != ver_b else {},
        "tuning": tuning,
        "environment": _dict_diff(a.environment, b.environment),
        "summary": {"source": {"a": source_text(a.source), "b": source_text(b.source)},
                    "tuning": {"a": tune_a["text"] if tune_a else None, "b": tune_b["text"] if tune_b else None}},
    }
    result["identical"] = not (config_changes or files["added"] or files["removed"] or files["changed"]
                               or result["members"] or result["engine"] or result["source"]
                               or result["verification"] or tuning)
    return result


def promotion_diff(planned: PlannedPromotion) -> dict[str, Any] | None:
    """The diff between what the target environment serves now and the version a planned promotion would
    point it at (None when it serves nothing yet)."""
    plan, stores = planned.plan, planned.stores
    if plan.replaces is None:
        return None
    try:
        return diff_manifests(stores.target.get_manifest(plan.model, plan.replaces),
                              stores.source.get_manifest(plan.model, plan.version))
    except TrmError as exc:  # a missing or corrupt manifest is the checksums gate's to report, not the plan's
        return {"model": plan.model, "a": plan.replaces, "b": plan.version, "unavailable": exc.message}


def _value(value: Any) -> str:
    """A changed value as JSON writes it (quoted texts, [lists], {mappings}), never a Python repr."""
    if value is None:
        return "(none)"
    text = json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


WIDTH = 100
"""Longest line of `trm diff`'s text: longer ones (a long path, a long value) continue indented."""


def _fit(line: str, width: int = WIDTH) -> list[str]:
    if len(line) <= width:
        return [line]
    indent = " " * min(len(line) - len(line.lstrip(" ")) + 4, 12)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False,
                         drop_whitespace=True) or [line[:width]]


def diff_text(diff: dict[str, Any]) -> str:
    """The diff for a reader: one line per change, grouped by what changed, within ``WIDTH`` columns."""
    return "\n".join(part for line in _diff_lines(diff).splitlines() for part in _fit(line))


def _diff_lines(diff: dict[str, Any]) -> str:
    head = f"{diff['model']}: version {diff['a']} -> {diff['b']}"
    if diff.get("unavailable"):
        return f"{head}: no diff ({diff['unavailable']})"
    if diff["identical"]:
        return head + ": no differences (same config, files, source, verification and tuning)"
    lines = [head]
    if diff["config"]:
        lines.append("config:")
        lines += [f"  {c['field']}: {_value(c['a'])} -> {_value(c['b'])}" for c in diff["config"]]
    files = diff["files"]
    if files["added"] or files["removed"] or files["changed"]:
        lines.append(f"files ({files['unchanged']} unchanged; {human_size(files['bytes']['a'])} -> "
                     f"{human_size(files['bytes']['b'])}):")
        lines += [f"  + {f['path']} ({human_size(f['size'])}, sha256 {f['sha256'][:12]})" for f in files["added"]]
        lines += [f"  - {f['path']} ({human_size(f['size'])}, sha256 {f['sha256'][:12]})" for f in files["removed"]]
        lines += [f"  ~ {f['path']} ({human_size(f['a_size'])} -> {human_size(f['b_size'])}, sha256 "
                  f"{f['a_sha256'][:12]} -> {f['b_sha256'][:12]})" for f in files["changed"]]
    else:
        lines.append(f"files: identical ({files['unchanged']} files, same sha256)")
    for key, title in (("members", "ensemble members"), ("engine", "engine arguments (model.json)"),
                       ("source", "source"), ("tuning", "tuning")):
        summary = diff["summary"].get(key, {})
        if not diff.get(key):
            continue
        if key == "source" and diff["source"] and any(c["field"] == "kind" for c in diff["source"]) or \
                key == "tuning" and None in (summary["a"], summary["b"]):
            # another kind of source, or tuning added/removed: one line says it better than every field
            lines.append(f"{title}: {summary['a'] or '(none)'} -> {summary['b'] or '(none)'}")
            continue
        lines.append(f"{title}:")
        lines += [f"  {c['field']}: {_value(c['a'])} -> {_value(c['b'])}" for c in diff[key]]
    if diff["verification"]:
        lines.append(f"verification: {diff['verification']['a']['text']} -> {diff['verification']['b']['text']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ validate

def validate_repository(root: str | Path, *, fix: bool = False) -> dict[str, Any]:
    repo = LocalRepository(root)
    fixed: list[str] = []
    if fix and repo.root.is_dir():
        fixed += [f"removed {p}" for p in repo.clean_staging()]
        for model in repo.models():
            try:
                if repo.repair_config(model):
                    fixed.append(f"rewrote {model}/config.pbtxt from its latest manifest")
                fixed += [f"rewrote {path} to name its own version folder" for path in repo.localize(model)]
            except Exception as exc:  # noqa: BLE001 - reported by validate below
                fixed.append(f"could not repair {model}: {exc}")
    problems = repo.validate()
    models, notes = repo.scan()
    return {"repository": str(root), "ok": not problems, "problems": [str(p) for p in problems],
            "fixed": fixed, "notes": notes, "models": len(models),
            "versions": sum(len(repo.versions(m)) for m in models)}
