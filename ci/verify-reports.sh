#!/usr/bin/env bash
# docs/CI.md's workflow on the real SmolLM2, as a CI job would run it (ci/test.sh runs this
# after ci/accuracy.sh, whose files in target/accuracy it reuses):
#
# - a correct model passes `kiln-verify layers` (exit 0), with a JUnit file of no failures;
# - a model with one corrupted layer (layer 5's MLP down projection scaled by 1.5 in the
#   checkpoint, then converted as usual, so every checksum is valid) fails with exit 1, and its
#   JUnit file's first failing test case is that layer's output;
# - perplexity gates pass when generous and fail (exit 1, the gate named) when not;
# - the HTML reports render in a real browser (Debian's chromium, installed if missing):
#   the layers page has one chart point per activation site in each of its two charts, the
#   perplexity page one histogram bar per bin, and a screenshot of each is taken;
# - every JUnit file written (layers, perplexity, integrity, diff; passing and failing) is valid
#   against the JUnit schema: Maven Surefire's junit-10.xsd, the one Jenkins reads, taken from
#   the copy pytest's source distribution on PyPI carries for its own JUnit tests (fetched once
#   into target/cache), with the xmlschema package; and the schema does refuse a test case
#   without a name, so the check can fail.
#
# Ends with an "N passed, N failed" line; exit status 1 if any check failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bin=target/release
acc=target/accuracy
out=target/verify-reports
rm -rf "$out"
mkdir -p "$out"
py="$(ci/python-env.sh)"
for f in q8_0.kiln q4_0-cal.kiln f32.logits; do
    [ -f "$acc/$f" ] || { echo "verify-reports: $acc/$f is missing; run ci/accuracy.sh first" >&2; exit 2; }
done

if ! command -v chromium > /dev/null; then
    echo "verify-reports: installing Debian's chromium" >&2
    apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
fi

passed=0
failed=0
check() {  # check DESCRIPTION COMMAND...
    local what="$1"; shift
    if "$@"; then
        passed=$((passed + 1)); echo "ok    $what"
    else
        failed=$((failed + 1)); echo "FAIL  $what"
    fi
}
status() {  # status WANT COMMAND...: the command exits with WANT
    local want="$1"; shift
    set +e
    "$@" > /dev/null 2>> "$out/stderr.log"
    local got=$?
    set -e
    [ "$got" = "$want" ] || { echo "      exit $got, expected $want: $*" >&2; return 1; }
}
ref=fixtures/reference/smollm2/0.safetensors

# 1. The correct model passes, with a JUnit file of no failures and a report.
check "layers: q8_0 passes (exit 0)" status 0 "$bin/kiln-verify" layers "$acc/q8_0.kiln" \
    --reference "$ref" --tolerance q8_0 --json --junit "$out/layers.xml" --report "$out/layers.html"
"$bin/kiln-verify" layers "$acc/q8_0.kiln" --reference "$ref" --json > "$out/layers.json"
check "layers: JUnit of the passing model has no failures" \
    "$py" - "$out/layers.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag == "testsuites", root.tag
cases = root.findall("./testsuite/testcase")
assert cases and root.get("failures") == "0", (len(cases), root.get("failures"))
assert not root.findall(".//failure")
PY

# 2. One corrupted layer: exit 1, and the JUnit file names that layer's site first.
bad_dir="$out/smollm2-bad-layer5"
cp -rL target/models/smollm2-bf16 "$bad_dir"
"$py" - "$bad_dir/model.safetensors" <<'PY'
# Scale one BF16 tensor in place in the safetensors file (numpy has no bf16: through f32,
# rounding to nearest even as PyTorch does).
import json, struct, sys
import numpy as np
path = sys.argv[1]
with open(path, "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    t = header["model.layers.5.mlp.down_proj.weight"]
    assert t["dtype"] == "BF16", t["dtype"]
    start, end = t["data_offsets"]
    f.seek(8 + n + start)
    u = np.frombuffer(f.read(end - start), dtype=np.uint16).astype(np.uint32)
    x = (u << 16).view(np.float32) * np.float32(1.5)
    v = x.view(np.uint32)
    v = (v + 0x7FFF + ((v >> 16) & 1)) >> 16
    f.seek(8 + n + start)
    f.write(v.astype(np.uint16).tobytes())
PY
"$bin/kiln-convert" hf "$bad_dir" -o "$out/bad.kiln" --dtype f32 --force > /dev/null
check "layers: the corrupted model fails (exit 1)" status 1 "$bin/kiln-verify" layers \
    "$out/bad.kiln" --reference "$ref" --junit "$out/bad.xml"
check "layers: JUnit's first failure is layer 5's output" \
    "$py" - "$out/bad.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
cases = root.findall("./testsuite/testcase")
failing = [c.get("name") for c in cases if c.find("failure") is not None]
assert failing, "no failing test case"
assert failing[0] == "model.layers.5.output", failing[:3]
# Everything before layer 5 passed.
names = [c.get("name") for c in cases]
assert all(c.find("failure") is None for c in cases[: names.index(failing[0])])
assert int(root.get("failures")) == len(failing)
PY

# 3. Perplexity gates against the f32 model's saved logits.
gate() {
    "$bin/kiln-verify" perplexity "$acc/q4_0-cal.kiln" --text fixtures/text/gpl-3.txt -c 512 \
        --chunks 2 --kl-base "$acc/f32.logits" "$@"
}
check "perplexity: generous gates pass (exit 0)" status 0 gate --max-kld 1 --max-ppl-ratio 2 \
    --junit "$out/ppl.xml" --report "$out/ppl.html"
check "perplexity: --max-kld 0.001 fails (exit 1)" status 1 gate --max-kld 0.001 \
    --junit "$out/ppl-strict.xml"
check "perplexity: JUnit names the failed gate" \
    "$py" - "$out/ppl-strict.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
failing = [c.get("name") for c in root.iter("testcase") if c.find("failure") is not None]
assert failing == ["--max-kld"], failing
PY

# 4. Every JUnit file against the JUnit schema.
check "integrity: passes (exit 0) with a JUnit file" status 0 "$bin/kiln-verify" integrity \
    "$acc/q8_0.kiln" --junit "$out/integrity.xml"
check "diff: q8_0 against q4_0-cal passes (exit 0) with a JUnit file" status 0 "$bin/kiln-verify" diff \
    "$acc/q8_0.kiln" "$acc/q4_0-cal.kiln" --junit "$out/diff.xml"
xsd_dir=target/cache/junit-xsd
xsd="$xsd_dir/junit-10.xsd"
if [ ! -s "$xsd" ]; then
    mkdir -p "$xsd_dir"
    "$py" -m pip download --quiet --no-deps --no-binary :all: pytest==8.4.2 -d "$xsd_dir" > /dev/null
    "$py" - "$xsd_dir/pytest-8.4.2.tar.gz" "$xsd" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    data = t.extractfile("pytest-8.4.2/testing/example_scripts/junit-10.xsd").read()
open(sys.argv[2] + ".tmp", "wb").write(data)
import os
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PY
fi
valid() {  # valid FILE.xml: the file is valid against the JUnit schema
    "$py" - "$xsd" "$1" <<'PY'
import sys, xmlschema
xmlschema.XMLSchema(sys.argv[1]).validate(sys.argv[2])
PY
}
for f in layers bad ppl ppl-strict integrity diff; do
    check "JUnit schema: $f.xml is valid" valid "$out/$f.xml"
done
sed 's/<testcase name="[^"]*"/<testcase/' "$out/layers.xml" > "$out/unnamed.xml"
check "JUnit schema: refuses a test case without a name" status 1 valid "$out/unnamed.xml"

# 5. The reports in a real browser.
browser() {
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars "$@" 2> /dev/null
}
sites="$("$py" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["entries"]))' "$out/layers.json")"
browser --dump-dom "file://$root/$out/layers.html" > "$out/layers.dom"
points="$(grep -o '<circle class="point"' "$out/layers.dom" | wc -l)"
check "browser: layers report has a point per site in both charts ($points for $sites sites)" \
    test "$points" -eq $((2 * sites))
browser --dump-dom "file://$root/$out/ppl.html" > "$out/ppl.dom"
check "browser: perplexity report has its KL-divergence histogram" \
    test "$(grep -o '<rect class="bin"' "$out/ppl.dom" | wc -l)" -gt 0
for page in layers ppl; do
    browser --window-size=1280,1600 --screenshot="$root/$out/$page.png" "file://$root/$out/$page.html" > /dev/null
    check "browser: screenshot of the $page report" test -s "$out/$page.png"
done

echo "verify-reports: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
