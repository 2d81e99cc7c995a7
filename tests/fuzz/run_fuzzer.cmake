# SPDX-License-Identifier: Apache-2.0
# Runs one libFuzzer target for SECONDS on a fresh working corpus grown from SEEDS; fails on any
# finding (a crash, a sanitizer report, an uncaught exception, a timeout or running out of memory),
# which libFuzzer writes under FINDINGS.
#   cmake -DFUZZER=<binary> -DSEEDS=<dir> -DWORK=<dir> -DFINDINGS=<dir> -DSECONDS=<n> -P run_fuzzer.cmake
cmake_minimum_required(VERSION 3.19)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}" "${FINDINGS}")
get_filename_component(name "${FUZZER}" NAME)
# -timeout: one input may take 10 s; -rss_limit_mb: a parser must not need more than 2 GB.
execute_process(
  COMMAND "${FUZZER}" -max_total_time=${SECONDS} -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
          "-artifact_prefix=${FINDINGS}/${name}-" "${WORK}" "${SEEDS}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(REGEX MATCH "stat::number_of_executed_units: *[0-9]+" runs "${out}")
string(REGEX MATCH "#[0-9]+[^\n]*DONE[^\n]*" done "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${name}: a finding (exit ${rc}); the input is under ${FINDINGS}:\n${out}")
endif()
message("${name}: no finding in ${SECONDS} s (${runs}); ${done}")
