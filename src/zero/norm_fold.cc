// src/zero/norm_fold.cc — see norm_fold.h.
#include "zero/norm_fold.h"

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tiermem::detail {

bool has_real(std::size_t sub_groups, const ModuleNormFold::ValidLen& valid) {
  for (std::size_t j = 0; j < sub_groups; ++j) {
    if (valid(j) > 0) return true;
  }
  return false;
}

void ModuleNormFold::skip_empty(std::size_t sub_groups, const ValidLen& valid) {
  while (next_ < sub_groups && valid(next_) == 0) {
    if (next_ == 0) running_ = 0;
    ++next_;
  }
}

void ModuleNormFold::complete(std::size_t j, std::size_t sub_groups, const ValidLen& valid, const AddSubGroup& add) {
  std::size_t first_real = 0;
  while (first_real < sub_groups && valid(first_real) == 0) ++first_real;
  if (j == first_real) {  // the module's first sub-group of this reduce call
    next_ = 0;
    broken_ = false;
  }
  skip_empty(sub_groups, valid);
  if (j != next_) {
    broken_ = true;
    return;
  }
  running_ = add(running_);
  ++next_;
  skip_empty(sub_groups, valid);
}

bool ModuleNormFold::ready(std::size_t sub_groups, const ValidLen& valid) const {
  if (!has_real(sub_groups, valid)) return true;  // adds nothing
  return !broken_ && next_ == sub_groups;
}

// ------------------------------------------------------------------ the lane sums of squares

namespace {
// 32 double lanes (element i in lane i mod 32) as four 8-wide vectors (GCC vector extensions: the
// same lanes whatever instructions the compiler picks, so the sum does not depend on the ISA; a
// float product is exact in double, so neither does FMA contraction). Lane order at the end.
typedef float F8 __attribute__((vector_size(32), aligned(4)));
typedef double D8 __attribute__((vector_size(64)));
constexpr std::size_t kLanes = 32;

inline void add_block(D8 acc[4], const float* x) {
  for (int q = 0; q < 4; ++q) {
    F8 f;
    std::memcpy(&f, x + 8 * q, sizeof f);
    const D8 d = __builtin_convertvector(f, D8);
    acc[q] += d * d;
  }
}

inline double lane_sum(const D8 acc[4], const float* tail, std::size_t rest) {
  double lane[kLanes];
  for (int q = 0; q < 4; ++q)
    for (int j = 0; j < 8; ++j) lane[8 * q + j] = acc[q][j];
  for (std::size_t j = 0; j < rest; ++j) lane[j] += static_cast<double>(tail[j]) * tail[j];
  double sum = 0;
  for (double x : lane) sum += x;
  return sum;
}
}  // namespace

double sumsq_lanes(const float* g, std::size_t n) {
  D8 acc[4] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) add_block(acc, g + i);
  return lane_sum(acc, g + i, n - i);
}

namespace {
// One block of kLanes floats from src to dst; with `stream`, by non-temporal stores (dst 16-byte
// aligned): the destination is a gradient partition the CPU reads next at the optimizer step, or
// never (it is written to NVMe), so its lines need not be read for ownership nor kept in cache.
inline void copy_block(float* dst, const float* src, bool stream) {
#if defined(__x86_64__)
  if (stream) {
    for (std::size_t k = 0; k < kLanes; k += 4) _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, kLanes * sizeof(float));
}

inline void stream_fence(bool stream) {
#if defined(__x86_64__)
  if (stream) _mm_sfence();  // the streamed stores are seen before the pin's release
#endif
  (void)stream;
}

// Below this many floats the destination may as well stay in cache.
constexpr std::size_t kStreamMinElems = std::size_t{1} << 16;  // 256 KiB

inline bool streamable(const float* dst, std::size_t n) {
#if defined(__x86_64__)
  return n >= kStreamMinElems && reinterpret_cast<std::uintptr_t>(dst) % 16 == 0;
#else
  (void)dst, (void)n;
  return false;
#endif
}

// Copies src[0, n) to dst (non-temporal stores when `stream`), whole blocks of kLanes below `m`
// one at a time, each handed to on_block while in cache and then zeroed in `clear` when given; the
// rest (the tail, and what lies past m) by memcpy. Returns where the whole blocks ended.
template <class OnBlock>
std::size_t copy_blocks(float* dst, const float* src, std::size_t n, std::size_t m, float* clear, bool stream,
                        OnBlock on_block) {
  std::size_t i = 0;
  for (; i + kLanes <= m; i += kLanes) {
    copy_block(dst + i, src + i, stream);
    on_block(src + i);
    if (clear) std::memset(clear + i, 0, kLanes * sizeof(float));  // its lines are in cache now
  }
  std::memcpy(dst + i, src + i, (n - i) * sizeof(float));
  if (clear) std::memset(clear + i, 0, (n - i) * sizeof(float));
  stream_fence(stream);
  return i;
}
}  // namespace

double copy_sumsq_lanes(float* dst, const float* src, std::size_t n, std::size_t n_sum, float* clear) {
  const std::size_t m = std::min(n, n_sum);
  D8 acc[4] = {};
  // Whole blocks are summed from src before `clear` zeroes them; the last partial block from its
  // copy in dst (the same values), since `clear` may be src.
  const auto add = [&](const float* block) { add_block(acc, block); };
  const std::size_t i = copy_blocks(dst, src, n, m, clear, streamable(dst, n), add);
  return lane_sum(acc, dst + i, m - i);
}

void copy_lanes(float* dst, const float* src, std::size_t n, float* clear, bool read_next) {
  copy_blocks(dst, src, n, n, clear, !read_next && streamable(dst, n), [](const float*) {});
}

}  // namespace tiermem::detail
