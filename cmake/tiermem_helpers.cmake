# tiermem_library(NAME <name> SOURCES ... [CUDA_SOURCES ...] DEPS ...)
#   defines the static library tiermem_<name> with the alias tiermem::<name>, the public headers
#   of include/ and the project's warnings. CUDA_SOURCES are compiled only when CUDA was found.
#   Symbols are hidden unless marked TIERMEM_API (tiermem/export.h): the installed library
#   (cmake/tiermem_install.cmake) is made of these objects, and a shared one exports only the API.
function(tiermem_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${TIERMEM_WERROR}>>:-Werror>)
endfunction()

function(tiermem_library)
  cmake_parse_arguments(T "" "NAME" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(srcs ${T_SOURCES})
  if(TIERMEM_HAVE_CUDA)
    list(APPEND srcs ${T_CUDA_SOURCES})
  endif()
  if(NOT srcs)
    return()  # nothing written yet in this folder
  endif()
  add_library(tiermem_${T_NAME} STATIC ${srcs})
  add_library(tiermem::${T_NAME} ALIAS tiermem_${T_NAME})
  target_include_directories(tiermem_${T_NAME} PUBLIC ${PROJECT_SOURCE_DIR}/include PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(tiermem_${T_NAME} PUBLIC ${T_DEPS} PRIVATE ${T_PRIVATE_DEPS})
  if(TIERMEM_HAVE_CUDA)
    target_compile_definitions(tiermem_${T_NAME} PUBLIC TIERMEM_HAVE_CUDA=1)
  endif()
  set_target_properties(tiermem_${T_NAME} PROPERTIES CXX_VISIBILITY_PRESET hidden
                        CUDA_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
  tiermem_set_warnings(tiermem_${T_NAME})
endfunction()

# tiermem_test(NAME <name> SOURCES ... DEPS ... [LABELS ...] [TIMEOUT s])
#   a GoogleTest binary registered with ctest (one ctest entry per binary, with a timeout).
function(tiermem_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/tests)
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS} GTest::gtest GTest::gtest_main Threads::Threads)
  tiermem_set_warnings(${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "unit;${T_LABELS}")
endfunction()

# tiermem_tool(NAME <program> SOURCES ... DEPS ...)
#   a program of tools/: written to build/<preset>/bin/, src/ on its include path (private
#   headers as "train/train_loop.h"), the project's warnings; `cmake --install` puts it in bin/.
function(tiermem_tool)
  cmake_parse_arguments(T "" "NAME" "SOURCES;DEPS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${T_NAME} PRIVATE ${T_DEPS})
  set_target_properties(${T_NAME} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
  tiermem_set_warnings(${T_NAME})
  install(TARGETS ${T_NAME} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endfunction()
