#!/usr/bin/env bash
# Bounded fuzzing run (CI step, also handy locally): builds the cargo-fuzz crate in fuzz/ on the
# nightly toolchain and runs every target for FUZZ_SECONDS (default 20) seconds, one worker each,
# starting from its committed corpus (fuzz/corpus/<target>, plus fuzz/regressions/<target>).
# New inputs go to a scratch directory, never into the committed corpus. A crash, timeout or
# out-of-memory fails the step; libFuzzer leaves the input in fuzz/artifacts/<target>/.
# Without a nightly toolchain it says so and skips (the corpora still replay on stable in
# `cargo test`, tests/fuzz_corpora.rs); without cargo-fuzz it installs it.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${FUZZ_SECONDS:-20}"
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: skipped: no nightly toolchain (rustup toolchain install nightly); corpora still replay in cargo test"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo +nightly install cargo-fuzz --locked
fi

# The blk and fs targets create scratch files per input: on tmpfs their fsyncs cost nothing.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then
    export TMPDIR=/dev/shm
fi

cd fuzz
cargo +nightly fuzz build -O
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for t in $(cargo +nightly fuzz list); do
    dirs=("corpus/$t")
    [ -d "regressions/$t" ] && dirs+=("regressions/$t")
    mkdir -p "$scratch/$t"
    echo "fuzz: $t for ${secs}s"
    # -timeout: an input that takes 10 s is a hang (libFuzzer's default is 20 minutes).
    rc=0
    cargo +nightly fuzz run -O "$t" "$scratch/$t" "${dirs[@]}" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1 >"$scratch/$t.log" 2>&1 || rc=$?
    # The final stats, and the report of a finding; libFuzzer's progress lines stay in the log.
    grep -E '^(stat::number_of_executed_units|stat::average_exec_per_sec|==[0-9]+== ERROR|SUMMARY|Test unit written|thread .* panicked)' \
        "$scratch/$t.log" || true
    if [ "$rc" -ne 0 ]; then
        tail -n 40 "$scratch/$t.log"
        echo "fuzz: $t failed (the input is in fuzz/artifacts/$t/)"
        exit 1
    fi
done
echo "fuzz: every target ran ${secs}s without a finding"
