#!/usr/bin/env bash
# The concurrency-heavy suites under the sanitizers; any report fails the run.
#
# address: AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/: clang++-14 -O1
#   -fsanitize=address,undefined, no CUDA, no benchmarks): every unit suite (CTest label unit)
#   and every integration suite (label integration); the process tests start sanitized servers
#   (router, workers, store, `infinigen serve` with its HTTP front door), and a report in a
#   server's log fails the test that ran it (servers end by SIGKILL: their leaks are not
#   checked, the test processes' are). One test is left out:
#   Cli.PrepareThenEvalEveryPolicy (SmolLM2 evaluated through every policy: 400 s under ASan;
#   prepare, eval and the policies run under ASan in infinigen_test and the other cli tests).
#   LeakSanitizer skips the third-party leaks in scripts/lsan_suppressions.txt. ~15 minutes to
#   build from scratch on 2 cores with clang -O1 (41 with g++ -O2 -g), ~6 to run (CI of
#   2026-11-29, AMD EPYC VM).
# thread: ThreadSanitizer (build-tsan/): the services' shutdown signal handler (TSan reports a
#   call that is not async-signal-safe inside a handler), the health service, the batch engine,
#   the engine's attach path, memory admission, the store cache, the KV client queue, the KV
#   transports (gRPC, shm, UCX), the router's relay and pool, and the router and worker process
#   tests (their servers, `infinigen serve` included, are TSan builds too; a report in a server's
#   log fails the test that ran it). abseil's synchronization and status libraries are rebuilt with
#   -fsanitize=thread from Debian's own source of the installed version (same ABI, same
#   SONAME, loaded first through LD_LIBRARY_PATH) so that TSan sees every absl::Mutex and
#   Status refcount, ours and gRPC's;
#   gRPC itself stays uninstrumented (scripts/tsan_suppressions.txt says what that hides).
#   The CPU kernels run on one thread (OMP_NUM_THREADS=1 sizes their team, kernels/cpu/team.h;
#   OpenBLAS's libgomp is not instrumented), except in the team's own tests (cpu_kernels_test's
#   TeamTest: teams of 2 and 3 threads, a GEMM split across them); UCX's memory hooks are off
#   (they call into TSan from exiting threads).
#   ~7 minutes to build on 2 cores at -O1 -g1 (abseil: one), ~3 to run (CI of 2026-11-29).
# usage: scripts/sanitize.sh [address|thread]...   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A suite_args=()  # per target: extra gtest arguments

build() {  # build dir, targets...: a failure shows the compiler's words (ninja writes them to stdout)
  local dir="$1"; shift
  if ! cmake --build "$dir" --target "$@" > "$dir/build.log" 2>&1; then
    grep -E -A12 '^FAILED|error:' "$dir/build.log" | head -n 80
    echo "sanitize: building in $dir FAILED (log: $dir/build.log)" >&2
    exit 1
  fi
}

run_suites() {  # build dir, targets...
  local dir="$1"; shift
  for t in "$@"; do
    # shellcheck disable=SC2086  # the arguments are words
    if ! "$dir/bin/$t" --gtest_brief=1 ${suite_args[$t]:-} > "$dir/$t.log" 2>&1; then
      tail -n 80 "$dir/$t.log"
      echo "sanitize: $t FAILED (log: $dir/$t.log)" >&2
      exit 1
    fi
    echo "sanitize: $t: $(grep -o '[0-9]* tests\?' "$dir/$t.log" | tail -1) passed, no report"
  done
}

address() {
  # Every unit suite, then every integration suite.
  local targets=(common_test cpu_kernels_test checkpoint_test proto_test key_limits_test
                 utf8_fields_test health_test ghz_config_test metrics_exposer_test tokenizer_test
                 request_validation_test frontend_text_test cli_flags_test openai_json_test
                 json_prefix_test
                 selection_test kv_store_test arena_prefaulter_test queued_client_test
                 staging_ring_test router_test
                 hf_fixture_test tokenizer_fixture_test infinigen_test infinigen_reference_test
                 decode_step_alloc_test memory_admission_test speculation_test
                 store_kv_cache_test store_kv_device_plan_test store_kv_pool_test engine_attach_test
                 store_kv_reuse_shm_test batch_engine_test
                 kv_transport_test ucx_data_plane_test kv_store_process_test
                 worker_process_test router_process_test netns_test generate_calls_test
                 openai_http_test cli_test)
  suite_args[cli_test]="--gtest_filter=-Cli.PrepareThenEvalEveryPolicy"
  # clang at -O1 with line tables only: the build took 41 minutes on 2 cores with g++ -O2 -g
  # (its sanitizers make the big gRPC/Boost test files 4-5 times slower to compile), about a
  # quarter of that with clang; a second compiler also checks the code.
  if [[ -f build-asan/CMakeCache.txt ]] && ! grep -q '^CMAKE_CXX_COMPILER:.*clang' build-asan/CMakeCache.txt; then
    rm -rf build-asan
  fi
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DINFINIGEN_SANITIZE=ON \
    -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only -DNDEBUG" \
    -DINFINIGEN_WITH_CUDA=OFF -DINFINIGEN_BUILD_BENCHMARKS=OFF >/dev/null
  build build-asan "${targets[@]}" infinigen infinigen-router infinigen-worker infinigen-kvstore
  ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    LSAN_OPTIONS="suppressions=$PWD/scripts/lsan_suppressions.txt" \
    run_suites build-asan "${targets[@]}"
}

# abseil's synchronization and status libraries (and what they use) built with
# -fsanitize=thread from Debian's source of the installed libabsl (checked against the .dsc's
# SHA-256 sums) into build-tsan/absl/lib.
tsan_abseil() {
  local lib=build-tsan/absl/lib version upstream src pool
  version="$(dpkg-query -W -f='${Version}\n' 'libabsl2*' | head -n 1)"
  [[ -f "$lib/.version" && "$(cat "$lib/.version")" == "$version" ]] && return 0
  upstream="${version%-*}"
  src=build-tsan/absl/src
  rm -rf build-tsan/absl && mkdir -p "$src"
  for pool in http://deb.debian.org/debian/pool/main/a/abseil \
              http://security.debian.org/debian-security/pool/updates/main/a/abseil; do
    curl -fsSL -o "$src/abseil.dsc" "$pool/abseil_${version}.dsc" || continue
    curl -fsSL -o "$src/abseil_${upstream}.orig.tar.gz" "$pool/abseil_${upstream}.orig.tar.gz"
    curl -fsSL -o "$src/abseil_${version}.debian.tar.xz" "$pool/abseil_${version}.debian.tar.xz"
    break
  done
  if [[ ! -s "$src/abseil.dsc" ]]; then
    echo "sanitize: no Debian source for abseil $version" >&2
    exit 1
  fi
  (cd "$src" && sed -n '/^Checksums-Sha256:/,/^[^ ]/p' abseil.dsc | grep '^ ' |
     awk '{print $1 "  " $3}' | sha256sum -c --quiet -)
  tar -xzf "$src/abseil_${upstream}.orig.tar.gz" -C "$src"
  local tree="$src/abseil-${upstream}"
  tar -xJf "$src/abseil_${version}.debian.tar.xz" -C "$tree"
  while read -r p; do
    [[ -z "$p" || "$p" == \#* ]] || patch -s -p1 -d "$tree" < "$tree/debian/patches/$p"
  done < "$tree/debian/patches/series"
  cmake -S "$tree" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DCMAKE_CXX_FLAGS=-fsanitize=thread \
    -DCMAKE_C_FLAGS=-fsanitize=thread -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread \
    >"$src/build.log" 2>&1 || { tail -n 40 "$src/build.log"; exit 1; }
  ninja -C "$src/build" synchronization status >>"$src/build.log" 2>&1 ||
    { tail -n 40 "$src/build.log"; exit 1; }
  mkdir -p "$lib"
  find "$src/build" -name 'libabsl_*.so.*' -exec cp -P {} "$lib/" \;
  echo "$version" > "$lib/.version"
}

thread() {
  local targets=(common_test cpu_kernels_test health_test queued_client_test staging_ring_test
                 router_test arena_prefaulter_test
                 store_kv_cache_test store_kv_device_plan_test store_kv_reuse_shm_test
                 batch_engine_test memory_admission_test engine_attach_test kv_transport_test
                 ucx_data_plane_test
                 router_process_test worker_process_test)
  suite_args[common_test]="--gtest_filter=ShutdownSignal.*"
  suite_args[cpu_kernels_test]="--gtest_filter=TeamTest.*"
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DINFINIGEN_SANITIZE_THREAD=ON -DINFINIGEN_WITH_CUDA=OFF -DINFINIGEN_BUILD_BENCHMARKS=OFF \
    >/dev/null
  tsan_abseil
  build build-tsan "${targets[@]}" infinigen infinigen-router infinigen-worker infinigen-kvstore
  LD_LIBRARY_PATH="$PWD/build-tsan/absl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    OMP_NUM_THREADS=1 UCX_MEM_EVENTS=no \
    TSAN_OPTIONS="suppressions=$PWD/scripts/tsan_suppressions.txt second_deadlock_stack=1" \
    run_suites build-tsan "${targets[@]}"
}

modes=("$@")
[[ ${#modes[@]} -gt 0 ]] || modes=(address thread)
for m in "${modes[@]}"; do
  case "$m" in
    address) address ;;
    thread) thread ;;
    *) echo "usage: scripts/sanitize.sh [address|thread]..." >&2; exit 2 ;;
  esac
done
