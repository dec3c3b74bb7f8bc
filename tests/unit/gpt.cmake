# GPT model (src/gpt): layer gradient checks (double, finite differences), whole-model tests.
if(TARGET tiermem_gpt)
tiermem_test(NAME gpt_test SOURCES gpt_layers_test.cc gpt_model_test.cc gpt_row_math_test.cc gpt_backend_test.cc gpt_checkpointing_test.cc DEPS tiermem::gpt
  LABELS gpt TIMEOUT 120)
endif()
