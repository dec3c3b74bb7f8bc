// gpu_log.h (internal) — logging for .cu files. nvcc cannot compile spdlog/fmt's consteval format
// strings in C++20 mode, so CUDA sources log through these plain functions (defined in device.cc,
// compiled by the host compiler) with preformatted messages, tag GPU.
#pragma once

#include <string>

namespace tiermem::detail {
void gpu_log_warn(const std::string& message);
void gpu_log_error(const std::string& message);
}  // namespace tiermem::detail
