# The samples of examples/ run as tests: exit status 0 and the output that shows they did their
# job (the MLP's loss falls; every paged tensor holds its value after NVMe traffic). Label "examples".
foreach(sample zero_mlp tensor_store_paging)
  if(TARGET ${sample})
    add_test(NAME example_${sample}
             COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/examples_test.sh ${sample} $<TARGET_FILE:${sample}>)
    set_tests_properties(example_${sample} PROPERTIES TIMEOUT 60 LABELS "examples")
  endif()
endforeach()
