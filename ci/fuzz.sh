#!/usr/bin/env bash
# Fuzz the .kiln and GGUF readers, chat-template rendering and tokenizer loading for a fixed
# time: ci/fuzz.sh [SECONDS] [OTHER_SECONDS] (defaults 60 for the .kiln reader, 30 for each
# other target)
#
# Runs the cargo-fuzz target `reader` (fuzz/fuzz_targets/reader.rs), which opens arbitrary
# bytes with KilnFile::from_bytes and, when a file is accepted, touches every view and verifies
# every checksum; then the target `gguf` (fuzz/fuzz_targets/gguf.rs), which parses arbitrary
# bytes as GGUF and, when a header is accepted, slices and dequantizes every tensor and rebuilds
# the tokenizer; then `template` (fuzz/fuzz_targets/template.rs), which compiles arbitrary
# text as a chat template and renders it the way kiln-run does, in a resource-limited child
# (the release kiln-run, built here), and `tokenizer` (fuzz/fuzz_targets/tokenizer.rs), which
# loads arbitrary text as an embedded tokenizer.json and encodes, decodes and streams with it.
# Exits non-zero if the fuzzer finds a crash; the input that caused it is left
# in fuzz/artifacts/<target>/ (reproduce with `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> FILE`).
#
# Toolchain: cargo-fuzz needs nightly-only flags (-Zsanitizer=address, sanitizer coverage).
# Only the stable toolchain can be installed here, so the script sets RUSTC_BOOTSTRAP=1, which
# lets the stable compiler accept them; this is harmless on a nightly toolchain.
#
# The committed seeds (fuzz/corpus/reader/, made by
# `cargo run -p kiln-format --example fuzz_seed_corpus -- fuzz/corpus/reader`; fuzz/corpus/gguf/,
# made by `cargo run -p kiln-convert --example gguf_seed_corpus -- fuzz/corpus/gguf`;
# fuzz/corpus/template/ and fuzz/corpus/tokenizer/, written by hand: real templates and two
# small tokenizers, one also with a tokenizer_config.json after a NUL byte, which kiln-runner's
# tests load) are read but
# never written: inputs the fuzzer discovers go to a scratch directory, so the repository's
# corpus stays small. Set KILN_FUZZ_CORPUS=DIR to keep discoveries in DIR across runs.
set -euo pipefail

duration="${1:-60}"
gguf_duration="${2:-30}"
for d in "$duration" "$gguf_duration"; do
    if ! [[ "$d" =~ ^[0-9]+$ ]] || [ "$d" -eq 0 ]; then
        echo "usage: ci/fuzz.sh [SECONDS] [OTHER_SECONDS]   (positive whole numbers, default 60 30)" >&2
        exit 2
    fi
done

cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "ci/fuzz.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1

scratch="${KILN_FUZZ_CORPUS:-}"
if [ -z "$scratch" ]; then
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
fi
mkdir -p "$scratch"

# The first corpus directory receives new inputs; the second (the seeds) is only read.
# -max_len keeps inputs near the size of the seeds, where the interesting structure is.
# -timeout flags a single input that takes over 10 s (a hang) as a failure (30 s for templates).
mkdir -p "$scratch/reader" "$scratch/gguf" "$scratch/template" "$scratch/tokenizer"
cargo fuzz run reader "$scratch/reader" fuzz/corpus/reader -- \
    -max_total_time="$duration" -max_len=4096 -timeout=10 -print_final_stats=1
cargo fuzz run gguf "$scratch/gguf" fuzz/corpus/gguf -- \
    -max_total_time="$gguf_duration" -max_len=4096 -timeout=10 -print_final_stats=1
# The template target's renderer child is the release kiln-run, as users run it. Its timeout
# is above the child's own 20 s CPU limit, which ends a slow rendering as a reported error.
cargo build --release -p kiln-run --bin kiln-run
KILN_RUN="$PWD/target/release/kiln-run" cargo fuzz run template "$scratch/template" fuzz/corpus/template -- \
    -max_total_time="$gguf_duration" -max_len=4096 -timeout=30 -print_final_stats=1
cargo fuzz run tokenizer "$scratch/tokenizer" fuzz/corpus/tokenizer -- \
    -max_total_time="$gguf_duration" -max_len=4096 -timeout=10 -print_final_stats=1
