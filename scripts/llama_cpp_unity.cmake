# Unity build for llama.cpp's host-side C++ (scripts/llama_cpp.sh passes it as CMAKE_PROJECT_INCLUDE).
#
# Why: llama-common, the server and mtmd are ~40 files that each parse nlohmann/json and the STL again; batched
# into a few translation units they compile in 3.4 instead of 4.5 min on 2 Zen 4 cores (measured 2026-12-07, the
# same targets, nothing else running): a minute off a fresh machine's setup, which ends with this compile. ggml,
# the kernels every measured token runs, is not touched: its objects build exactly as the sdist builds them.
# llama's own CMakeLists already builds its model files as a unity build (and keeps its core files out of it).
#
# Two files cannot share a translation unit: common/json.cpp specializes a template that an earlier file has
# already instantiated, and mtmd-helper*.cpp refuse mtmd's internal headers by #error. If a future llama.cpp
# adds another such clash, llama_cpp.sh rebuilds without this file (one warning line), never fails on it.
if(CMAKE_SOURCE_DIR STREQUAL PROJECT_SOURCE_DIR)  # included after every project(); act once, for the top level
  function(_qb_unity)
    set_target_properties(llama-common server-context llama-server-impl mtmd PROPERTIES UNITY_BUILD ON)
    set_source_files_properties(${CMAKE_SOURCE_DIR}/common/json.cpp TARGET_DIRECTORY llama-common
                                PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
    set_source_files_properties(${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp
                                ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp TARGET_DIRECTORY mtmd
                                PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  endfunction()
  # the targets exist only once every subdirectory is read: set their properties at the end of the top level
  cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _qb_unity)
endif()
