#!/usr/bin/env bash
# `kiln-run serve` on the real SmolLM2-135M-Instruct (Q8_0), through its clients' eyes:
#
# - the OpenAI API with the official `openai` Python client: chat and completions, streamed
#   and not, chunk rules, usage and temperature-0 text equal to `kiln-run generate --json`'s,
#   logprobs, JSON-schema output validated with `jsonschema`, and the refusals (400 naming the
#   parameter, 401, 404) (cli/tests/serve/test_api.py);
# - batch invariance: eight questions asked together answer exactly as each asked alone
#   (test_batch.py);
# - the chat page at / in Debian's chromium (installed if missing), driven over the DevTools
#   protocol: error shown, key kept, streamed answer with a tok/s figure, two turns, Stop
#   (test_page.py; KILN_SCREENSHOT=docs/serve-chat.png saves its screenshot);
# - a bounded load-and-fault run on 127.0.0.1: 32 streaming clients, hang-ups mid-stream, an
#   oversized body, malformed JSON, stalled half-sent requests, a burst of connections; then
#   every slot free and memory back near its warm-up level (test_load.py).
#
# Builds the release binaries as ci/accuracy.sh does (a no-op after it) and makes
# target/serve/q8_0.kiln from the bf16 checkpoint if it is missing. Each part runs under a hard
# timeout. Ends with an "N passed, N failed" line; exit status 1 if any part failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

ci/smollm2.sh >&2
cargo build --release --workspace --bins
bin=target/release
out=target/serve
mkdir -p "$out"
py="$(ci/python-env.sh)"

model="$out/q8_0.kiln"
if [ ! -s "$model" ]; then
    echo "serve: making $model" >&2
    "$bin/kiln-convert" hf target/models/smollm2-bf16 -o "$out/bf16.kiln" --force > /dev/null
    "$bin/kiln-quantize" "$out/bf16.kiln" "$model.tmp" --to q8_0 --force > /dev/null
    mv "$model.tmp" "$model"
    rm -f "$out/bf16.kiln"
fi

if ! command -v chromium > /dev/null; then
    echo "serve: installing Debian's chromium" >&2
    apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
fi

export KILN_BIN="$root/$bin" KILN_SERVE_MODEL="$root/$model"

passed=0
failed=0
part() {  # part SECONDS FILE DESCRIPTION
    local limit="$1" file="$2" what="$3"
    echo "--    $what ($file, at most ${limit} s)"
    local rc=0
    timeout -k 10 "$limit" "$py" -m unittest discover -s cli/tests/serve -p "$file" -v \
        > "$out/${file%.py}.log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1)); echo "ok    $what"
    else
        [ "$rc" -eq 124 ] && echo "      timed out after ${limit} s"
        failed=$((failed + 1)); echo "FAIL  $what (exit $rc; log below)"
        tail -n 60 "$out/${file%.py}.log"
    fi
    grep -E '^(test_|Ran |OK|FAILED)' "$out/${file%.py}.log" | sed 's/^/      /' || true
}

part 150 test_api.py "OpenAI API: chat, completions, streaming, usage, logprobs, JSON schema, refusals"
part 120 test_batch.py "batch invariance: 8 concurrent questions answer as each alone"
part 120 test_page.py "chat page in chromium: streamed answer, tok/s, two turns, Stop, errors"
part 270 test_load.py "load and faults: 32 streams, hang-ups, 413, bad JSON, stalls, burst; slots free, memory back"

echo "serve: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
