#!/usr/bin/env bash
# The admin API with curl: create a run, change it live, read its episodes, metrics,
# versions and workers, download a checkpoint, scrape /metrics, then stop and delete it.
#   RLGATE_URL=http://127.0.0.1:8000 RLGATE_ADMIN_KEY=... bash examples/admin.sh
set -euo pipefail
url="${RLGATE_URL:-http://127.0.0.1:8000}"
auth="Authorization: Bearer ${RLGATE_ADMIN_KEY:?set RLGATE_ADMIN_KEY}"
json='Content-Type: application/json'
field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }

run=$(curl -sSf "$url/admin/v1/runs" -H "$auth" -H "$json" \
  -d '{"name": "admin-example", "model": "tiny", "config": {"group_size": 2}}')
run_id=$(echo "$run" | field '["run_id"]')
key=$(echo "$run" | field '["api_key"]')
echo "created $run_id"

# one agent call, so the run has an episode to show
curl -sSf "$url/episodes/admin-ex-1/v1/chat/completions" -H "Authorization: Bearer $key" \
  -H "$json" -d '{"model": "admin-example", "max_tokens": 8,
                  "messages": [{"role": "user", "content": "What is 2 + 3?"}]}' >/dev/null

# rename, and change a knob that is safe on a live run
curl -sSf -X PATCH "$url/admin/v1/runs/$run_id" -H "$auth" -H "$json" \
  -d '{"name": "admin-example-2", "config": {"max_staleness": 2}}' | field '["name"]'

curl -sSf "$url/admin/v1/runs/$run_id/episodes?status=open&limit=10" -H "$auth" \
  | field '["data"][0]["episode_id"]'
curl -sSf "$url/admin/v1/runs/$run_id/episodes/admin-ex-1" -H "$auth" \
  | field '["completions"][0]["output_tokens"][0]'
curl -sSf "$url/admin/v1/runs/$run_id/metrics" -H "$auth" | field '["names"]'
curl -sSf "$url/admin/v1/runs/$run_id/counters" -H "$auth" | field '["episodes_by_status"]'
curl -sSf "$url/admin/v1/runs/$run_id/versions" -H "$auth" | field '[0]["version"]'
curl -sSf "$url/admin/v1/workers" -H "$auth" | field '["pending_steps"]'

# version 0's checkpoint (the base model) as a tar stream
curl -sSf "$url/admin/v1/runs/$run_id/versions/0/checkpoint" -H "$auth" -o "/tmp/$run_id-v0.tar"
tar tf "/tmp/$run_id-v0.tar" | sed -n 1,3p  # sed reads it all: head could end tar with SIGPIPE
rm -f "/tmp/$run_id-v0.tar"

curl -sSf "$url/metrics" -H "$auth" | grep "^rlgate_completions_total{run_id=\"$run_id\""

# delete refuses an active run (409); stop it first
curl -sS -o /dev/null -w "delete active: %{http_code}\n" -X DELETE "$url/admin/v1/runs/$run_id" -H "$auth"
curl -sSf -X POST "$url/admin/v1/runs/$run_id/stop" -H "$auth" | field '["status"]'
curl -sSf -X DELETE "$url/admin/v1/runs/$run_id" -H "$auth"
echo
