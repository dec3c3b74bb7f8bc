// gpt/model.h — a GPT-2-style transformer whose parameters are grouped per module, so that a
// ZeRO-3 engine can gather one module's parameters just before it runs and release them after.
//
// Architecture (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"; the
// GPT-2 reference code): learned token (wte) and position (wpe) embeddings, n_layer pre-LayerNorm
// blocks (causal multi-head self-attention, GELU(tanh) MLP of width 4·d_model, each added to the
// residual stream), a final LayerNorm, the output head tied to wte (logits = h·wteᵀ), mean
// cross-entropy over all B·T positions.
//
// Parameters and modules. The parameters form n_layer + 2 MODULES, each one contiguous fp32 (or
// bf16) flat buffer whose tensors sit at fixed element offsets (module_layout()):
//   module 0          "embed"   wte [vocab, d], wpe [seq_len, d]
//   module 1..L       "block.i" ln1_w, ln1_b [d]; qkv_w [3d, d], qkv_b [3d]; proj_w [d, d],
//                               proj_b [d]; ln2_w, ln2_b [d]; fc_w [4d, d], fc_b [4d];
//                               fc_proj_w [d, 4d], fc_proj_b [d]
//   module L+1        "ln_f"    lnf_w, lnf_b [d]
// Linear weights are [out, in] row-major (as torch.nn.Linear): y = x·Wᵀ + b.
//
// Steps and the access order. Computation runs as STEPS; each step reads exactly one module's
// parameters. Because the output head is tied to wte, module 0 is used twice:
//   forward:  kEmbed(0), kBlock(1) .. kBlock(L), kFinalNorm(L+1), kHead(0)   [kHead computes loss]
//   backward: kHead(0), kFinalNorm(L+1), kBlock(L) .. kBlock(1), kEmbed(0)
// (forward_steps() / backward_steps() return exactly these lists.) Gradients ACCUMULATE (+=) into
// the module-sized fp32 span the caller passes, so module 0's gradient is complete only after the
// last backward step, kEmbed; every other module's gradient is complete right after its one
// backward step (the engine may reduce-scatter it then). The caller zeroes gradient buffers
// before the first backward step of an accumulation window. kEmbed's backward reads no
// parameters: it accepts an empty ParamView, so the engine need not gather module 0 again for it.
//
// The driver loop the trainer writes (see Model::forward_backward() for the same in code):
//   model.set_batch(tokens, targets);
//   for (Step s : forward_steps(cfg))  { p = gather(s.module); model.forward(s, p); release(p); }
//   float loss = model.loss();
//   for (Step s : backward_steps(cfg)) { p = gather(s.module);
//                                        model.backward(s, p, grad_of(s.module)); release(p);
//                                        if (s.module != 0 || s.kind == StepKind::kEmbed)
//                                          reduce_scatter(grad_of(s.module)); }
//
// Compute and activations. A Model owns every activation and activation gradient for one
// micro-batch of B sequences of T tokens (T <= cfg.seq_len) in host memory, fp32, and computes on
// the CPU: GEMMs through OpenBLAS cblas_sgemm, everything else plain C++ with OpenMP. Parameters
// given as bf16 are converted to fp32 into a scratch buffer owned by the Model on each step.
// Activation memory is activation_bytes() (dominated by B·T·vocab logits and
// n_layer·B·n_head·T² attention probabilities). CUDA kernels for the same layers are declared in
// gpt/kernels_cuda.h.
//
// Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
// DeepSpeed's activation_checkpointing): a Model made with ModelOptions::checkpoint_blocks keeps,
// of each transformer block, only its input (the residual stream, B·T·d floats) across the
// forward pass; the block's intermediates (LayerNorm outputs, qkv, attention probabilities, MLP
// activations) live in ONE set of buffers that every block overwrites. A block's backward step
// first recomputes its forward from the kept input into those buffers (the same kernels on the
// same values: bitwise the same intermediates), then runs its backward. It reads the same
// parameters it is given for the backward step, so the engine gathers each module exactly as often
// as without checkpointing (the access trace is unchanged); the cost is one more forward of every
// block per backward pass (model FLOPs, flops_per_token(), do not count it).
//
// Units: counts are elements unless a name ends in _bytes; FLOPs count a multiply-add as 2.
// Thread-safety: GptConfig and the free functions are pure and thread-safe. A Model is not
// thread-safe: one thread drives it (it uses OpenMP and OpenBLAS threads inside each call).
// Errors: invalid configs or sizes throw tiermem::ConfigError (key path "gpt.<field>"); a
// parameter or gradient span of the wrong size, a step out of order, or a token id out of range
// throws tiermem::Error naming the step/module, expected and actual sizes.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tiermem/dtype.h"

namespace tiermem::gpt {

// ---------------------------------------------------------------------------------------------
// Configuration

struct GptConfig {
  int n_layer = 4;
  int n_head = 4;
  int d_model = 256;       // embedding width C; must be divisible by n_head
  int seq_len = 128;       // maximum sequence length (rows of wpe)
  int vocab_size = 256;    // number of token ids; ids are 0 .. vocab_size-1

  int head_dim() const { return d_model / n_head; }

  // Throws ConfigError("gpt.<field>", value, why) when a field is <= 0 or d_model % n_head != 0.
  void validate() const;

  // Named configurations:
  //   "tiny"        2 layers, 2 heads, d 32,  seq 16,   vocab 64     (~27 K params; tests)
  //   "mini"        4 layers, 4 heads, d 256, seq 128,  vocab 256    (~3.3 M; the default demo,
  //                 byte-level text, trains on 2 CPU cores)
  //   "gpt2"        12 layers, 12 heads, d 768,  seq 1024, vocab 50257 (124 M)
  //   "gpt2-medium" 24 layers, 16 heads, d 1024                      (355 M)
  //   "gpt2-large"  36 layers, 20 heads, d 1280                      (774 M)
  //   "gpt2-xl"     48 layers, 25 heads, d 1600                      (1.56 B)
  // Throws ConfigError("gpt.model", name, list of names) for anything else.
  static GptConfig named(std::string_view name);
  static std::vector<std::string> names();

  // "gpt2: 12 layers, 12 heads, d_model 768, seq_len 1024, vocab 50257, 124.44 M params".
  std::string describe(std::string_view name = "custom") const;
};

// ---------------------------------------------------------------------------------------------
// Parameter layout (pure functions of the config)

// One parameter tensor inside its module's flat buffer.
struct ParamTensor {
  std::string name;                  // "wte", "qkv_w", ...
  std::vector<std::int64_t> shape;   // row-major
  std::int64_t numel = 0;            // product of shape
  std::int64_t offset = 0;           // element offset within the module's flat buffer
};

struct ModuleLayout {
  int index = 0;                     // 0 .. n_layer+1
  std::string name;                  // "embed", "block.0" .. "block.{L-1}", "ln_f"
  std::vector<ParamTensor> tensors;  // in the order listed at the top of this file, contiguous
  std::int64_t numel = 0;            // elements in the module's flat buffer (sum of tensors)
};

int num_modules(const GptConfig& cfg);                            // n_layer + 2
ModuleLayout module_layout(const GptConfig& cfg, int module);     // throws Error if out of range
std::vector<ModuleLayout> module_layouts(const GptConfig& cfg);   // all modules, by index
std::int64_t num_params(const GptConfig& cfg);                    // all modules (wte counted once)

// Pointers to one transformer block's tensors inside its module buffer (parameters or their
// gradients), in module_layout()'s order; tests check them against module_layout().
template <class P>
struct BlockTensors {
  P *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *fc_proj_w,
      *fc_proj_b;
  BlockTensors(P* p, std::int64_t C) {
    auto take = [&p](std::int64_t n) {
      P* r = p;
      p += n;
      return r;
    };
    ln1_w = take(C), ln1_b = take(C), qkv_w = take(3 * C * C), qkv_b = take(3 * C);
    proj_w = take(C * C), proj_b = take(C), ln2_w = take(C), ln2_b = take(C);
    fc_w = take(4 * C * C), fc_b = take(4 * C), fc_proj_w = take(4 * C * C), fc_proj_b = take(C);
  }
};

// Model FLOPs per token of a training step (forward + backward = 3 × forward), the convention of
// Kaplan et al. 2020 / PaLM (Chowdhery et al. 2022, App. B): 2 FLOPs per multiply-add of every
// matmul (the four linears of each block and the tied head), attention counted as full T×T
// (QKᵀ and att·V: 4·T·d per layer forward), element-wise work ignored. With N_mm = the matmul
// parameters (12·L·d² + V·d), this is 6·N_mm + 12·L·T·d. `seq_len` defaults to cfg.seq_len.
double flops_per_token(const GptConfig& cfg, int seq_len = 0);
double forward_flops_per_token(const GptConfig& cfg, int seq_len = 0);

// GPT-2 initialisation of one module, deterministic from (seed, module) alone (so a rank can
// initialise just the modules or shards it owns): linear and embedding weights ~ N(0, 0.02²),
// the residual projections proj_w and fc_proj_w ~ N(0, (0.02/sqrt(2·n_layer))²), biases 0,
// LayerNorm weights 1 and biases 0. `out` must hold module_layout(cfg, module).numel elements.
void init_module(const GptConfig& cfg, int module, std::uint64_t seed, std::span<float> out);
// All modules, index = module.
std::vector<std::vector<float>> init_params(const GptConfig& cfg, std::uint64_t seed);

// ---------------------------------------------------------------------------------------------
// Steps

enum class StepKind : std::uint8_t { kEmbed, kBlock, kFinalNorm, kHead };

struct Step {
  StepKind kind;
  int module;  // whose parameters this step reads (kEmbed and kHead: 0)
  int layer;   // kBlock: 0 .. n_layer-1 (module = layer + 1); otherwise -1
};

std::vector<Step> forward_steps(const GptConfig& cfg);   // kEmbed, kBlock..., kFinalNorm, kHead
std::vector<Step> backward_steps(const GptConfig& cfg);  // the reverse
std::string step_name(const Step& s);                    // "embed", "block.3", "ln_f", "head"

// A module's parameters as the engine holds them: fp32, or bf16 (raw bits, as tiermem/dtype.h).
// A view; it does not own the memory, which must stay valid for the call it is passed to.
class ParamView {
 public:
  ParamView() = default;
  ParamView(std::span<const float> f32) : f32_(f32), dtype_(DType::kF32) {}  // NOLINT implicit
  ParamView(const std::vector<float>& f32) : ParamView(std::span<const float>(f32)) {}  // NOLINT
  static ParamView bf16(std::span<const std::uint16_t> bits) {
    ParamView v;
    v.bf16_ = bits;
    v.dtype_ = DType::kBF16;
    return v;
  }
  DType dtype() const { return dtype_; }
  std::size_t numel() const { return dtype_ == DType::kF32 ? f32_.size() : bf16_.size(); }
  std::span<const float> f32() const { return f32_; }
  std::span<const std::uint16_t> bf16_bits() const { return bf16_; }

 private:
  std::span<const float> f32_;
  std::span<const std::uint16_t> bf16_;
  DType dtype_ = DType::kF32;
};

// ---------------------------------------------------------------------------------------------
// The model: activations for one micro-batch, forward and backward one step at a time.

struct ModelOptions {
  // Keep only each block's input; recompute the block's forward in its backward step (see the
  // top of this file).
  bool checkpoint_blocks = false;
};

// Bytes of every activation and activation-gradient buffer Model(cfg, batch_size, seq_len, options)
// allocates (its activation_bytes(), computed without allocating; tokens not counted), saturated at
// UINT64_MAX for sizes no machine holds. Pure. For budgets (tiermem-plan) and Model's own refusal
// of activations beyond physical memory.
std::uint64_t activation_bytes(const GptConfig& cfg, int batch_size, int seq_len, bool checkpoint_blocks = false);

class Model {
 public:
  // Allocates activations for batch_size sequences of seq_len tokens (0 means cfg.seq_len;
  // must be <= cfg.seq_len). Throws ConfigError on invalid sizes.
  Model(const GptConfig& cfg, int batch_size, int seq_len = 0, ModelOptions options = {});

  const GptConfig& config() const { return cfg_; }
  int batch_size() const { return B_; }
  int seq_len() const { return T_; }
  bool checkpoints_blocks() const { return options_.checkpoint_blocks; }
  // Bytes of every activation and activation-gradient buffer, all allocated at construction:
  // the Model's activation memory and its peak (fp32, host memory).
  std::size_t activation_bytes() const;
  // Of those, the block inputs kept across the forward pass (n_layer + 1 residual streams of
  // B·T·d floats): with checkpoint_blocks, the checkpoints.
  std::size_t block_input_bytes() const;

  // Copies the micro-batch: tokens and targets are [batch_size, seq_len] row-major ids in
  // [0, vocab_size) (targets are usually tokens shifted by one). Throws Error on a wrong size or
  // an id out of range (naming the position and value).
  void set_batch(std::span<const std::int32_t> tokens, std::span<const std::int32_t> targets);

  // Runs one forward step with that step's module parameters (module_layout(s.module).numel
  // elements, fp32 or bf16). Steps must come in forward_steps() order after set_batch().
  void forward(const Step& s, ParamView params);

  // Mean cross-entropy (nats per token) of the last kHead forward step.
  float loss() const { return loss_; }

  // Runs one backward step; accumulates (+=) the module's parameter gradient into `grads`
  // (fp32, module_layout(s.module).numel elements; caller-owned, e.g. a buffer the engine will
  // reduce-scatter). Steps must come in backward_steps() order after the forward pass; kEmbed
  // accepts an empty `params`.
  void backward(const Step& s, ParamView params, std::span<float> grads);

  // The whole driver loop over resident parameters: set_batch, every forward step, every backward
  // step; grads[m] += dLoss/dParams[m]. Returns the loss. For tests, benchmarks and single-rank use.
  float forward_backward(const std::vector<std::vector<float>>& params,
                         std::vector<std::vector<float>>& grads,
                         std::span<const std::int32_t> tokens,
                         std::span<const std::int32_t> targets);
  // Forward only (evaluation): returns the loss.
  float forward_all(const std::vector<std::vector<float>>& params,
                    std::span<const std::int32_t> tokens, std::span<const std::int32_t> targets);

  // Activations of the last forward pass, for tests: probabilities [B·T, vocab] of the kHead step.
  std::span<const float> probs() const { return probs_; }

 private:
  struct Layer;
  std::span<const float> as_f32(const Step& s, ParamView params, bool allow_empty);
  void check_step(const Step& s, bool backward);
  // The intermediates of block `layer` (the one shared set with checkpoint_blocks).
  Layer& layer_activations(int layer);
  // Block `layer`'s forward from resid_[layer] into `a`; writes its output resid_[layer + 1]
  // unless `intermediates_only` (the recompute: backward needs everything but the output).
  void block_forward(int layer, std::span<const float> params, Layer& a, bool intermediates_only);

  GptConfig cfg_;
  ModelOptions options_;
  int B_ = 0;
  int T_ = 0;
  std::vector<std::int32_t> tokens_, targets_;
  std::vector<float> scratch_params_;  // bf16 -> fp32 conversions
  float loss_ = 0;
  int next_forward_ = 0;   // index into forward_steps()
  int next_backward_ = -1; // index into backward_steps(); -1: no forward pass completed

  // Activations (N = B·T rows, C = d_model).
  struct Layer {
    std::vector<float> ln1, ln1_mean, ln1_rstd, qkv, att, atty, resid_mid;
    std::vector<float> ln2, ln2_mean, ln2_rstd, fch, fch_gelu;
  };
  std::vector<std::vector<float>> resid_;  // resid_[l]: input of block l; resid_[L]: of ln_f
  std::vector<Layer> layers_;  // one per block; a single shared one with checkpoint_blocks
  std::vector<float> lnf_, lnf_mean_, lnf_rstd_, probs_;
  // Activation gradients (reused across layers).
  std::vector<float> d_resid_, d_resid_mid_, d_ln_, d_qkv_, d_att_, d_atty_, d_fch_, d_fch_gelu_;
  std::vector<float> d_tmp_;
};

}  // namespace tiermem::gpt
