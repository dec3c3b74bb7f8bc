# tiermem-train (src/train: train_*, data, checkpoint): unit tests of its pieces, and
# end-to-end runs of the binary (tests/unit/train_e2e.sh) with small settings. Label "train".
if(TARGET tiermem_train)
  tiermem_test(NAME train_unit_test
               SOURCES train_data_test.cc train_checkpoint_test.cc train_options_test.cc train_lr_schedule_test.cc train_device_test.cc
               DEPS tiermem_train LABELS train TIMEOUT 60)
  tiermem_test(NAME train_e2e_test SOURCES train_e2e_test.cc
               DEPS nlohmann_json::nlohmann_json tiermem::core LABELS train TIMEOUT 240)
  target_compile_definitions(train_e2e_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>")
  add_dependencies(train_e2e_test tiermem-train)
  tiermem_test(NAME train_model_test SOURCES train_model_test.cc
               DEPS nlohmann_json::nlohmann_json LABELS train TIMEOUT 240)
  target_compile_definitions(train_model_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>")
  add_dependencies(train_model_test tiermem-train)
endif()
if(TARGET tiermem_train AND TARGET tiermem_zero AND MPI_CXX_FOUND)
  tiermem_test(NAME train_mpi_test SOURCES train_mpi_test.cc
               DEPS nlohmann_json::nlohmann_json LABELS "train;mpi" TIMEOUT 300)
  target_compile_definitions(train_mpi_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>")
  add_dependencies(train_mpi_test tiermem-train)
endif()
if(TARGET tiermem_train AND TARGET tiermem_zero)
  tiermem_test(NAME train_memory_test SOURCES train_memory_test.cc
               DEPS nlohmann_json::nlohmann_json LABELS train TIMEOUT 240)
  target_compile_definitions(train_memory_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>")
  add_dependencies(train_memory_test tiermem-train)
endif()
if(TARGET tiermem_train AND TARGET tiermem_zero)
  # Issue 32: every host budget from the named minimum to 4x it finishes (1 and 2 ranks, with and
  # without a CPU hog); a pinned pool pins what it uses.
  tiermem_test(NAME train_budget_test SOURCES train_budget_test.cc
               DEPS nlohmann_json::nlohmann_json LABELS train TIMEOUT 600)
  target_compile_definitions(train_budget_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>")
  add_dependencies(train_budget_test tiermem-train)
endif()
# The re-partitioning of a saved ZeRO optimizer state (include/tiermem/checkpoint_reshard.h), on
# synthetic checkpoints.
tiermem_test(NAME train_reshard_test SOURCES train_reshard_test.cc
             DEPS tiermem::train_state LABELS train TIMEOUT 60)
