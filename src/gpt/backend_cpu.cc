// gpt/backend_cpu.cc — the CPU backend (backend.h): gpt::Model behind ModelBackend; the byte
// count of the CUDA backend (pure, so a build without CUDA can size budgets too).
#include <utility>

#include "gpt/backend.h"
#include "gpt/backend_layout.h"
#include "tiermem/error.h"

namespace tiermem::gpt {
namespace {

class CpuBackend final : public ModelBackend {
 public:
  CpuBackend(const GptConfig& cfg, int batch_size, int seq_len, ModelOptions options)
      : model_(cfg, batch_size, seq_len, options) {}
  std::string name() const override { return "cpu"; }
  const GptConfig& config() const override { return model_.config(); }
  int batch_size() const override { return model_.batch_size(); }
  int seq_len() const override { return model_.seq_len(); }
  std::size_t activation_bytes() const override { return model_.activation_bytes(); }
  bool on_device() const override { return false; }
  bool checkpoints_blocks() const override { return model_.checkpoints_blocks(); }
  std::size_t block_input_bytes() const override {
    return model_.checkpoints_blocks() ? model_.block_input_bytes() : 0;
  }
  void set_batch(std::span<const std::int32_t> tokens,
                 std::span<const std::int32_t> targets) override {
    model_.set_batch(tokens, targets);
  }
  void forward(const Step& s, ParamView params) override { model_.forward(s, params); }
  float loss() override { return model_.loss(); }
  void backward(const Step& s, ParamView params, std::span<float> grads) override {
    model_.backward(s, params, grads);
  }

 private:
  Model model_;
};

}  // namespace

std::unique_ptr<ModelBackend> make_cpu_backend(const GptConfig& cfg, int batch_size,
                                               int seq_len, ModelOptions options) {
  return std::make_unique<CpuBackend>(cfg, batch_size, seq_len, options);
}

std::uint64_t cuda_backend_bytes(const GptConfig& cfg, int batch_size, int seq_len) {
  return CudaBackendLayout(cfg, batch_size, seq_len > 0 ? seq_len : cfg.seq_len, 0).bytes;
}

#if !TIERMEM_HAVE_CUDA
std::unique_ptr<ModelBackend> make_cuda_backend(const GptConfig&, int, int, int) {
  throw NotSupportedError(
      "the CUDA model backend: this build has no CUDA (configure with -DTIERMEM_WITH_CUDA=ON)");
}
#endif

}  // namespace tiermem::gpt
