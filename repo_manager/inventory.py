"""Read-only views of the local repository: list, show, validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from repo_manager import config as cfg
from repo_manager.repository import LocalRepository


def list_models(root: str | Path) -> list[dict[str, Any]]:
    repo = LocalRepository(root)
    rows = []
    for model in repo.models():
        versions = repo.versions(model)
        rows.append({"model": model, "versions": versions, "latest": versions[-1] if versions else None})
    return rows


def show_model(root: str | Path, name: str, version: int | None = None) -> dict[str, Any]:
    repo = LocalRepository(root)
    config = repo.config(name)
    manifest = repo.manifest(name, version)
    return {
        "model": name,
        "versions": repo.versions(name),
        "config": cfg.summarize(config),
        "manifest": {
            "version": manifest.version, "created_at": manifest.created_at, "files": len(manifest.files),
            "bytes": manifest.total_size, "source": manifest.source, "environment": manifest.environment,
            "verification": manifest.verification, "members": manifest.members,
            "tuning": manifest.tuning, "config": cfg.summarize(cfg.parse_config(manifest.config)),
        },
    }


def validate_repository(root: str | Path, *, fix: bool = False) -> dict[str, Any]:
    repo = LocalRepository(root)
    fixed: list[str] = []
    if fix and repo.root.is_dir():
        fixed += [f"removed {p}" for p in repo.clean_staging()]
        for model in repo.models():
            try:
                if repo.repair_config(model):
                    fixed.append(f"rewrote {model}/config.pbtxt from its latest manifest")
            except Exception as exc:  # noqa: BLE001 - reported by validate below
                fixed.append(f"could not repair {model}: {exc}")
    problems = repo.validate()
    models, notes = repo.scan()
    return {"repository": str(root), "ok": not problems, "problems": [str(p) for p in problems],
            "fixed": fixed, "notes": notes, "models": len(models),
            "versions": sum(len(repo.versions(m)) for m in models)}
