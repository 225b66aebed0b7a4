#!/usr/bin/env bash
# The model promotion pipeline, for any CI (GitHub Actions calls it from .github/workflows/promote.yml).
#
#   ci/pipeline.sh staging      on a push to main: publish every model of configs/models/ into the store,
#                               point staging at it, tune its batching (a config-only version, promoted to
#                               staging through the agreement gate)
#   ci/pipeline.sh production   on a tag or a manual approval: promote what staging serves to production,
#                               through the gates (docs/promotion.md)
#
# Every step runs `trm ... --json`, reads its exit code and JSON, and stops the pipeline with that exit
# code (0 ok, 8 another promotion won, 9 a gate failed; the table: README.md, docs/promotion.md).
#
# Environment:
#   TRM                       how to run trm (default: trm)
#   PYTHON                    a python3 to read JSON with (default: python3)
#   TRM_PIPELINE_WORK         scratch folder for the local repository (default: .trm-pipeline)
#   TRM_URL                   a running Triton for verification and gates (default: trm starts one)
#   TRM_PIPELINE_SKIP_TUNING  1: do not tune (also skipped when this trm has no tune-batching)
#   TRM_TUNE_BUDGET_S         seconds per model for tune-batching (default: 300, or what its rates need if more)
#   TRM_TUNE_REQUESTS         requests per measured tuning point (default: 1000)
#   TRM_TUNE_URL              tune on this server (it must serve the model); default: an embedded one
#   TRM_STAGING_GATES         gates for staging (default: checksums,load)
#   TRM_PROMOTE_GATES         gates for production (default: configs, i.e. auto)
#   stores, environments and gate thresholds: configs/trm.yaml; S3 credentials: the AWS chain.
set -euo pipefail

TRM=${TRM:-trm}
PYTHON=${PYTHON:-python3}
WORK=${TRM_PIPELINE_WORK:-.trm-pipeline}
REPO="$WORK/repo"
STAGING_GATES=${TRM_STAGING_GATES:-checksums,load}
URL_ARGS=()
[ -n "${TRM_URL:-}" ] && URL_ARGS=(--url "$TRM_URL")

log() { echo "[pipeline] $*" >&2; }

meaning() {
  # the table of repo_manager/core/errors.py (EXIT_CODES); tests/test_cli.py checks this copy against it
  case "$1" in
    0) echo "success" ;; 1) echo "internal error: a bug in trm (rerun with --verbose and report it)" ;;
    2) echo "bad command-line usage" ;; 3) echo "bad input" ;; 4) echo "not found" ;;
    5) echo "verification failed" ;; 6) echo "Triton is down, unreachable, or refused an operation" ;;
    7) echo "remote store error" ;;
    8) echo "lost a race (version number, environment pointer): retry; nothing was changed" ;;
    9) echo "a gate or SLO was not met; nothing was changed" ;;
    10) echo "a rollout failed and was rolled back" ;; 11) echo "an engine cannot run on this node" ;;
    129|130|143) echo "interrupted by a signal" ;; *) echo "an exit code trm does not use" ;;
  esac
}

# trm_json OUT ARGS...: run `trm ARGS --json`, its JSON into file OUT; on failure stop with trm's code.
trm_json() {
  local out=$1; shift
  local rc=0
  # shellcheck disable=SC2086  # TRM may be a command line such as "python -m repo_manager"
  $TRM "$@" --json >"$out" </dev/null || rc=$?
  if [ "$rc" -ne 0 ]; then
    log "trm $1 failed with exit code $rc ($(meaning "$rc")): $(json_get "$out" error.message 2>/dev/null || true)"
    exit "$rc"
  fi
}

# json_get FILE PATH: a value from a JSON file (dotted path; list items by index).
json_get() {
  "$PYTHON" - "$1" "$2" <<'PY'
import json, sys
value = json.load(open(sys.argv[1]))
for part in sys.argv[2].split("."):
    value = value[int(part)] if isinstance(value, list) else value[part]
print("" if value is None else (json.dumps(value) if isinstance(value, (dict, list)) else value))
PY
}

# models FILE: one tab-separated line per model spec: name, source, publish options, p99, low, peak
models() {
  "$PYTHON" - "$1" <<'PY'
import json, sys
for spec in json.load(open(sys.argv[1]))["models"]:
    options = []
    if spec.get("format"):
        options += ["--format", spec["format"]]
    for key, value in (spec.get("publish") or {}).items():
        flag = "--" + key.replace("_", "-")
        options += [flag] if value is True else ([f"--no-{key.replace('_', '-')}"] if value is False else [flag, str(value)])
    slo = spec.get("slo") or {}
    print("\t".join([spec["name"], spec["source"] or "", " ".join(options),
                     *(str(slo.get(k, "")) for k in ("p99_ms", "low_rps", "peak_rps"))]))
PY
}

tuning_available() {
  [ "${TRM_PIPELINE_SKIP_TUNING:-0}" != "1" ] && $TRM tune-batching --help >/dev/null 2>&1
}

stage() {
  mkdir -p "$WORK"
  trm_json "$WORK/specs.json" specs
  local store
  store=$(json_get "$WORK/specs.json" environments.staging)
  [ -n "$store" ] || { log "configs/trm.yaml gives no store for staging"; exit 2; }
  local count=0
  while IFS=$'\t' read -r name source options p99 low peak; do
    count=$((count + 1))
    log "$name: publishing $source into $store"
    # shellcheck disable=SC2086  # options are separate words
    trm_json "$WORK/publish-$name.json" publish model "$source" --name "$name" --repo "$REPO" --store "$store" \
      ${URL_ARGS[@]+"${URL_ARGS[@]}"} $options
    local version
    version=$(json_get "$WORK/publish-$name.json" version)
    trm_json "$WORK/stage-$name.json" promote "$name" --version "$version" --to staging --gates "$STAGING_GATES" \
      ${URL_ARGS[@]+"${URL_ARGS[@]}"}
    log "$name: staging serves version $version"
    if [ -z "$p99" ] || [ -z "$peak" ]; then
      log "$name: no slo in its spec; not tuned"
    elif ! tuning_available; then
      log "$name: tuning skipped (TRM_PIPELINE_SKIP_TUNING=1, or this trm has no tune-batching)"
    else
      log "$name: tuning batching for p99 <= $p99 ms at $low..$peak req/s"
      # on an embedded server on the local repository (this runner's hardware), or on TRM_TUNE_URL: a server
      # of the target hardware that serves the model (tune-batching measures the model it serves)
      local tune_args=(--requests "${TRM_TUNE_REQUESTS:-1000}")
      [ -n "${TRM_TUNE_BUDGET_S:-}" ] && tune_args+=(--budget "$TRM_TUNE_BUDGET_S")
      [ -n "${TRM_TUNE_URL:-}" ] && tune_args+=(--url "$TRM_TUNE_URL")
      trm_json "$WORK/tune-$name.json" tune-batching "$name" --repo "$REPO" --p99-ms "$p99" --low-rps "${low:-$peak}" \
        --peak-rps "$peak" --write "${tune_args[@]}"
      local tuned
      tuned=$(json_get "$WORK/tune-$name.json" written_version)
      if [ -n "$tuned" ]; then
        trm_json "$WORK/push-$name.json" push "$store" --repo "$REPO" --model "$name:$tuned"
        # the same files with another config: the agreement gate checks the answers did not change
        trm_json "$WORK/stage-tuned-$name.json" promote "$name" --version "$tuned" --to staging \
          --gates checksums,load,agreement ${URL_ARGS[@]+"${URL_ARGS[@]}"}
        log "$name: staging serves tuned version $tuned"
      else
        log "$name: the current config is already the best; nothing written"
      fi
    fi
  done < <(models "$WORK/specs.json")
  [ "$count" -gt 0 ] || log "no model specs in configs/models/"
}

release() {
  mkdir -p "$WORK"
  trm_json "$WORK/specs.json" specs
  local gates=()
  [ -n "${TRM_PROMOTE_GATES:-}" ] && gates=(--gates "$TRM_PROMOTE_GATES")
  while IFS=$'\t' read -r name _rest; do
    log "$name: promoting what staging serves to production"
    trm_json "$WORK/promote-$name.json" promote "$name" --from staging --to production \
      ${gates[@]+"${gates[@]}"} ${URL_ARGS[@]+"${URL_ARGS[@]}"}
    if [ "$(json_get "$WORK/promote-$name.json" moved)" = "True" ]; then
      log "$name: production serves version $(json_get "$WORK/promote-$name.json" plan.version)" \
          "(was $(json_get "$WORK/promote-$name.json" plan.replaces))"
    else
      log "$name: production already serves version $(json_get "$WORK/promote-$name.json" plan.version)"
    fi
  done < <(models "$WORK/specs.json")
}

case "${1:-}" in
  staging) stage ;;
  production) release ;;
  *) echo "usage: $0 staging|production" >&2; exit 2 ;;
esac
