# SPDX-License-Identifier: Apache-2.0
# SETUP for expect_failure.cmake: copies the Fashion-MNIST folder DATA_DIR to WORK_DIR with
# train-images-idx3-ubyte.gz cut to its first 100000 bytes (a download that stopped half way).
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
foreach(name train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
  file(COPY "${DATA_DIR}/${name}" DESTINATION "${WORK_DIR}")
endforeach()
execute_process(COMMAND head -c 100000 "${DATA_DIR}/train-images-idx3-ubyte.gz"
                OUTPUT_FILE "${WORK_DIR}/train-images-idx3-ubyte.gz" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "could not write a truncated copy of ${DATA_DIR}/train-images-idx3-ubyte.gz")
endif()
