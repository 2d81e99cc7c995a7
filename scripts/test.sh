#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the whole test suite on a fresh Debian machine: installs the Debian packages, then builds and
# tests (1) the host subset with CUDA off, (2) everything with CUDA on when nvcc exists, running what
# CUDA changes (GPU tests report "Skipped" without a GPU; nvcc's header checks; the package), (3) the threaded runtime under ThreadSanitizer, (4) every MPI
# path under AddressSanitizer and UndefinedBehaviorSanitizer, and the fuzz targets of every file a
# user hands over for 30 s each (clang, libFuzzer).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$root/scripts/setup.sh"
mkdir -p "$root/build"

echo "== host subset (CUPIPE_ENABLE_CUDA=OFF) at $(date -u +%H:%M:%S)"
# Tests and benchmarks on by name: run.sh turns them off in the same build dir.
all=(-DCUPIPE_BUILD_TESTS=ON -DCUPIPE_BUILD_EXAMPLES=ON -DCUPIPE_BUILD_BENCH=ON)
# In CI (CI=true: a fresh 2-core machine, nothing cached) the host stage compiles at -O1, which halves
# the compile time of these template-heavy programs against -O3 (measured: 228 s -> 120 s for
# test_pipeline_equivalence), and the unit tests and benchmarks at -O0, a third less again (128 s ->
# 80 s): their tests check results, and the unit tests together run in about a minute. The trainers,
# whose tests train, keep -O1. Elsewhere everything builds Release (-O3), because build/host also holds
# the benchmarks that docs/benchmarks.md runs.
# In CI no test runs a benchmark, so the benchmarks' C++ sources are checked with -fsyntax-only
# (CUPIPE_BENCH_SYNTAX_ONLY, bench/CMakeLists.txt): every error a build finds but a link error, in
# two fifths of the time. Elsewhere they build, for docs/benchmarks.md.
# In CI the MPI check programs (tests/comm/mpi_checks.cmake) are left to the ASan stage below, which
# builds and runs every one of them with AddressSanitizer and UBSan on: here they cost 295 CPU-s of
# compiling and 72 s of tests (50 checks, 2026-12-06) to repeat what that stage checks more strictly. The
# trainers' MPI runs stay here too, with every schedule and bf16 (the ASan stage's trainers have 1F1B).
host_ci=(-DCUPIPE_QUICK_COMPILE_OPTIONS= -DCUPIPE_TRAINER_SCHEDULES=all -DCUPIPE_BENCH_SYNTAX_ONLY=OFF -DCUPIPE_MPI_CHECKS=ON)  # named either way: a CMake cache keeps the last value
if [ "${CI:-}" = true ]; then
  all+=("-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" "-DCMAKE_CUDA_FLAGS_RELEASE=-O1 -DNDEBUG")
  host_ci=(-DCUPIPE_QUICK_COMPILE_OPTIONS=-O0 -DCUPIPE_TRAINER_SCHEDULES=all -DCUPIPE_BENCH_SYNTAX_ONLY=ON -DCUPIPE_MPI_CHECKS=OFF)
fi
build "$root/build/host" -DCUPIPE_ENABLE_CUDA=OFF "${all[@]}" "${host_ci[@]}"
(cd "$root/build/host" && ctest --output-on-failure -j "$jobs")

if have_cuda; then
  echo "== CUDA on (nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')) at $(date -u +%H:%M:%S)"
  # Only the test areas with CUDA, NCCL or package tests: the host-only areas are the same sources
  # the host stage built and ran (about 10 minutes of compiling on 2 cores saved).
  # In CI the trainers compile 1F1B only here (examples/common/trainer_schedules.hpp): no trainer runs
  # in this stage (its GPU tests skip), so it checks that their CUDA training loops compile, which one
  # schedule does; the host stage built and ran every schedule. The trainers' other CUDA families
  # (trainer_cuda_other.cu, 220 + 96 CPU-s at -O0) are compiled by builds with every schedule only,
  # not here: a known gap, which a change to those loops closes by building them by hand (gpu_pack.sh
  # builds the flush family; gpu_check.sh on the GPU machine builds them all).
  # In CI, where no GPU runs what it builds, device code is compiled for Hopper alone (one cicc and one
  # ptxas pass a file instead of two: 28% of test_cuda_ops.cu's compile time), and the examples and
  # benchmarks without CUDA code are left out (CUPIPE_CUDA_PROGRAMS_ONLY): the host stage built them.
  # Nothing this stage builds runs in CI beyond a skip, so its host code compiles at -O0 there (measured:
  # gpt_train's trainer_cuda.cu 232 s -> 161 s; the device code is optimized either way).
  # In CI the CUDA benchmarks, which no test runs, are compiled to PTX only (CUPIPE_BENCH_SYNTAX_ONLY,
  # bench/CMakeLists.txt): nvcc's front end checks their host and device code; GCC, ptxas and the link
  # are skipped.
  cuda_ci=(-DCUPIPE_TRAINER_SCHEDULES=all "-DCMAKE_CUDA_ARCHITECTURES=80;90" -DCUPIPE_CUDA_PROGRAMS_ONLY=OFF -DCUPIPE_BENCH_SYNTAX_ONLY=OFF)  # named either way: a CMake cache keeps the last value
  if [ "${CI:-}" = true ]; then
    cuda_ci=(-DCUPIPE_TRAINER_SCHEDULES=1f1b -DCMAKE_CUDA_ARCHITECTURES=90 -DCUPIPE_CUDA_PROGRAMS_ONLY=ON -DCUPIPE_BENCH_SYNTAX_ONLY=ON
             "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" "-DCMAKE_CUDA_FLAGS_RELEASE=-O0 -DNDEBUG")
  fi
  build "$root/build/cuda" -DCUPIPE_ENABLE_CUDA=ON "${all[@]}" "${cuda_ci[@]}" "-DCUPIPE_TEST_AREAS_ONLY=core;cuda;comm;examples;package"
  # What CUDA changes: the GPU tests (each skips without a GPU), nvcc's self-contained headers and the
  # installed package with cupipe::cuda. The host tests are the same sources as in the host subset,
  # which ran them above; on a machine with a GPU run `ctest` here without -L for everything.
  (cd "$root/build/cuda" && ctest --output-on-failure -j "$jobs" -L "gpu|cuda|package")
else
  echo "== CUDA on: skipped, no nvcc on this machine"
fi

echo "== ThreadSanitizer (runtime tests) at $(date -u +%H:%M:%S)"
build "$root/build/tsan" -DCUPIPE_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUPIPE_BUILD_TESTS=ON
(cd "$root/build/tsan" && ctest --output-on-failure -j "$jobs")

echo "== AddressSanitizer + UndefinedBehaviorSanitizer (clang): MPI ranks, fuzz smoke at $(date -u +%H:%M:%S)"
asan_targets=(mpi_pipeline_check mpi_expert_parallel_check mpi_fault_check mpi_progress_check mpi_tensor_parallel_check mpi_reshard_check mlp_fashion_mnist gpt_train cupipe_plan fuzz_seed_corpus fuzz_safetensors fuzz_idx fuzz_checkpoint
             fuzz_llmc_shard fuzz_plan_file fuzz_cost_model fuzz_gpt_import)
# The trainers with 1F1B only: their MPI checks run 1F1B (and --plan auto then plans among 1F1B's
# layouts), and every schedule would multiply the two slowest files' compile time under the
# sanitizers (examples/common/trainer_schedules.hpp; the host stage runs every schedule).
CC=clang CXX=clang++ build "$root/build/asan" -DCUPIPE_ASAN=ON -DCUPIPE_ENABLE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCUPIPE_BUILD_TESTS=ON -DCUPIPE_BUILD_EXAMPLES=ON -DCUPIPE_TRAINER_SCHEDULES=1f1b -- "${asan_targets[@]}"
# The MPI checks two at a time, as the host stage runs its own: one at a time they left the cores
# idle a third of the run (454 CPU-s of 704 in 352 s), as many of them wait on peers, on their
# ranks' start and on the stall checks' 3-s deadlines; two at a time they took 267 s (2026-12-07).
# The ones that time their ranks run alone (RUN_SERIAL). The fuzzers, which run for a fixed time, 4
# at once (7 targets: two rounds of CUPIPE_FUZZ_SECONDS).
# A failure in the first does not skip the second: both report, and the script fails after them.
failed=0
# The trainers' --plan auto runs calibrate quickly here (CUPIPE_CALIBRATION=quick, planner/rounds.hpp:
# one run and one round per profile): this stage checks their memory and UB, not the prediction, and
# the profiles' rounds took most of the 6 minutes of its 8 planning runs (354 s -> 235 s, 2026-12-06).
(cd "$root/build/asan" && CUPIPE_CALIBRATION=quick ctest --output-on-failure -j "$jobs" -L "mpi|build_variant" -LE multi_gpu) || failed=1
(cd "$root/build/asan" && ctest --output-on-failure -L fuzz -j 4) || failed=1
echo "== done at $(date -u +%H:%M:%S)"
exit "$failed"
