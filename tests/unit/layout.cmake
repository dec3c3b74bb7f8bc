# The layout rules of design.md and style.md (scripts/check-layout.py), one test per group so a
# failure names its room: layout_check (src/ and tools/: file and function sizes, includes that
# point down the dependency order, no bare includes), layout_check_python (no import cycle under
# python/tiermem, no import inside a function there but of an optional package, python/src
# includes only public headers), layout_check_engine (ZeroEngine::Impl holds at most 20 data
# members and 25 member functions), layout_check_api (every public declaration carries
# TIERMEM_API, so a shared libtiermem exports it); and the checker against trees that break each rule
# (tests/unit/check_layout_test.sh). docs_map_check: every path, file and code symbol
# docs/architecture.md names exists (scripts/check-docs-map.py), with its self-test
# (tests/unit/check_docs_map_test.sh). Label "layout".
find_program(TIERMEM_PYTHON3 python3)
if(TIERMEM_PYTHON3)
  foreach(group cpp python engine api)
    if(group STREQUAL "cpp")
      set(name layout_check)
    else()
      set(name layout_check_${group})
    endif()
    add_test(NAME ${name} COMMAND ${TIERMEM_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/check-layout.py
             --root ${PROJECT_SOURCE_DIR} --only ${group})
    set_tests_properties(${name} PROPERTIES TIMEOUT 60 LABELS "layout")
  endforeach()
  add_test(NAME layout_check_self_test COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/check_layout_test.sh
           ${TIERMEM_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/check-layout.py)
  set_tests_properties(layout_check_self_test PROPERTIES TIMEOUT 60 LABELS "layout")
  add_test(NAME docs_map_check COMMAND ${TIERMEM_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/check-docs-map.py
           --root ${PROJECT_SOURCE_DIR})
  add_test(NAME docs_map_check_self_test COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/check_docs_map_test.sh
           ${TIERMEM_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/check-docs-map.py)
  set_tests_properties(docs_map_check docs_map_check_self_test PROPERTIES TIMEOUT 60 LABELS "layout")
endif()
