# tiermem-train's command line against bad input (issue 8, helper "crash"): one-line errors and
# exit code 2. Runs the binary; label "train".
if(TARGET tiermem-train)
  tiermem_test(NAME train_cli_test SOURCES train_cli_test.cc LABELS train TIMEOUT 120)
  target_compile_definitions(train_cli_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>")
  add_dependencies(train_cli_test tiermem-train)
endif()
if(TARGET tiermem_train)
  tiermem_test(NAME train_manifest_test SOURCES train_manifest_test.cc DEPS tiermem_train
               LABELS train TIMEOUT 30)
endif()
