# The layout rules of design.md (scripts/check-layout.py): file and function sizes, includes that
# point down the dependency order, no bare includes; and the checker against a tree that breaks
# each rule (tests/unit/check_layout_test.sh). Label "layout".
find_program(TIERMEM_PYTHON3 python3)
if(TIERMEM_PYTHON3)
  add_test(NAME layout_check COMMAND ${TIERMEM_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/check-layout.py
           --root ${PROJECT_SOURCE_DIR})
  add_test(NAME layout_check_self_test COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/check_layout_test.sh
           ${TIERMEM_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/check-layout.py)
  set_tests_properties(layout_check layout_check_self_test PROPERTIES TIMEOUT 60 LABELS "layout")
endif()
