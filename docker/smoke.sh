#!/usr/bin/env bash
# docker/smoke.sh IMAGE [DOCKER RUN FLAGS...]: start a server image built from docker/Dockerfile.<platform>,
# wait until its HEALTHCHECK reports healthy, ask it for one completion through the OpenAI API, and remove
# the container. CI runs it on every image it builds (.github/workflows/ci.yml); the exit status is the verdict,
# and on failure the container's log is printed. SMOKE_TIMEOUT_S bounds the wait for healthy (default 1800).
set -euo pipefail

if [ "$#" -lt 1 ]; then
    echo "usage: docker/smoke.sh IMAGE [DOCKER RUN FLAGS...]" >&2
    exit 2
fi
image=$1
shift
name="engine-smoke-$$"

fail() {
    echo "smoke: $*" >&2
    docker logs --tail 200 "$name" >&2 || true
    exit 1
}
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT

docker run --detach --init --name "$name" "$@" "$image" >/dev/null
deadline=$((SECONDS + ${SMOKE_TIMEOUT_S:-1800}))
while true; do
    health=$(docker inspect --format '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$name")
    running=$(docker inspect --format '{{.State.Running}}' "$name")
    case "$health" in
        healthy) break ;;
        none) fail "$image has no HEALTHCHECK" ;;
    esac
    [ "$running" = true ] || fail "the server exited before it was healthy"
    [ "$SECONDS" -lt "$deadline" ] || fail "not healthy after ${SMOKE_TIMEOUT_S:-1800} s (health: $health)"
    sleep 10
done
echo "smoke: $image is healthy after ${SECONDS} s"

# The request goes from inside the container (its Python, its loopback), so the runner needs neither curl
# nor a published port.
docker exec "$name" python3 -c '
import json, sys, urllib.request
body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
request = urllib.request.Request("http://127.0.0.1:30000/v1/completions", body, {"Content-Type": "application/json"})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
choice = json.load(opener.open(request, timeout=300))["choices"][0]
print("smoke: completion", repr(choice["text"]), choice["finish_reason"])
sys.exit(0 if choice["text"].strip() and choice["finish_reason"] in ("length", "stop") else 1)
' || fail "the completion request failed"
