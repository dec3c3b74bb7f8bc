# tiermem-plan (src/plan, tools/tiermem-plan, docs/plan.md): the planner's bytes against tiermem-train's
# own summaries, the engine's refusal against the planner's minimum, and bad input. Runs both
# binaries on the tiny model; label "train".
if(TARGET tiermem-plan AND TARGET tiermem-train)
  tiermem_test(NAME plan_test SOURCES plan_test.cc
               DEPS tiermem_plan nlohmann_json::nlohmann_json LABELS train TIMEOUT 240)
  target_compile_definitions(plan_test PRIVATE TIERMEM_TRAIN_BIN="$<TARGET_FILE:tiermem-train>"
                             TIERMEM_PLAN_BIN="$<TARGET_FILE:tiermem-plan>")
  add_dependencies(plan_test tiermem-train tiermem-plan)
endif()
