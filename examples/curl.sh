#!/usr/bin/env bash
# Plain HTTP: a chat completion filed under an episode, then its reward.
#   RLGATE_BASE_URL=http://127.0.0.1:8000/v1 RLGATE_API_KEY=rlg-... RLGATE_MODEL=my-run bash examples/curl.sh
set -euo pipefail
root="${RLGATE_BASE_URL%/v1}"
auth="Authorization: Bearer ${RLGATE_API_KEY}"

curl -sS "$root/episodes/curl-1/v1/chat/completions" -H "$auth" -H 'Content-Type: application/json' \
  -d "{\"model\": \"${RLGATE_MODEL}\", \"max_tokens\": 16,
       \"messages\": [{\"role\": \"user\", \"content\": \"What is 2 + 3?\"}]}"
echo
curl -sS "$root/v1/rewards" -H "$auth" -H 'Content-Type: application/json' \
  -d '{"episode_id": "curl-1", "reward": 1.0, "idempotency_key": "curl-1-final"}'
echo
