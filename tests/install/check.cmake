# ctest "install": install the build tree into a scratch prefix, build an
# outside project against it with find_package(Tandem), and run it.
# Called with -DBUILD_DIR=... -DSOURCE_DIR=...
set(work ${BUILD_DIR}/install-check)
file(REMOVE_RECURSE ${work})
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${work}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install -B ${work}/build -G Ninja
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${work}/prefix)
run(${CMAKE_COMMAND} --build ${work}/build)
run(${work}/build/consumer)
run(${work}/build/consumer spawn)
run(${work}/build/consumer mesh)
run(${work}/build/consumer shard)
run(${work}/build/consumer checkpoint)
run(${work}/build/consumer tp)
run(${work}/build/consumer ft)
run(${work}/build/consumer ft_hsdp)
run(${work}/build/consumer ft_pipe)
# The same program traced (TANDEM_TRACE), its file joined by the installed
# tandem-trace: every layer's events are on the timeline.
run(${CMAKE_COMMAND} -E env TANDEM_TRACE=${work}/trace ${work}/build/consumer)
run(${work}/prefix/bin/tandem-trace merge ${work}/merged.json ${work}/trace)
file(READ ${work}/merged.json merged)
foreach(name "backward" "backward nodes" "DistributedOptimizer::step" "optimizer step"
        "allreduce" "F0@0")
  string(FIND "${merged}" "\"name\":\"${name}\"" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the consumer's trace has no '${name}' event")
  endif()
endforeach()

# What is installed is the public surface only: no installed header includes
# Cap'n Proto, kj or libuv (they stay inside the libraries), and every Tandem
# header an installed one includes is installed too.
file(GLOB_RECURSE installed RELATIVE ${work}/prefix/include ${work}/prefix/include/tandem/*.h)
foreach(header ${installed})
  file(STRINGS ${work}/prefix/include/${header} includes REGEX "^#include")
  foreach(line ${includes})
    if(line MATCHES "[<\"](capnp/|kj/|uv\\.h)")
      message(FATAL_ERROR "installed ${header} includes an internal dependency: ${line}")
    endif()
    if(line MATCHES "\"(tandem/[^\"]+)\"")
      # (CMAKE_MATCH_1 is read after the match, so in an if of its own.)
      if(NOT EXISTS ${work}/prefix/include/${CMAKE_MATCH_1})
        message(FATAL_ERROR "installed ${header} includes ${CMAKE_MATCH_1}, which is not installed")
      endif()
    endif()
  endforeach()
endforeach()
