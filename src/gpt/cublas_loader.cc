// gpt/cublas_loader.cc — cublas_api(): dlopen cuBLAS on first use (cublas_loader.h).
#include "gpt/cublas_loader.h"

#include <dlfcn.h>

#include <string>

#include "tiermem/error.h"

#ifndef TIERMEM_CUBLAS_DIR
#define TIERMEM_CUBLAS_DIR ""
#endif

namespace tiermem::gpt::cuda {
namespace {

struct Loaded {
  CublasApi api{};
  std::string error;  // empty when loaded
};

template <class F>
void bind(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) {
    const char* e = dlerror();
    *error = std::string("cuBLAS has no ") + name + ": " + (e ? e : "?");
  }
}

Loaded load() {
  Loaded l;
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = nullptr;
  std::string tried;
  for (const std::string& path :
       {soname, std::string(TIERMEM_CUBLAS_DIR) + "/" + soname, std::string("libcublas.so")}) {
    if (path.front() == '/' && std::string(TIERMEM_CUBLAS_DIR).empty()) continue;
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib != nullptr) break;
    const char* e = dlerror();
    tried += (tried.empty() ? "" : "; ") + path + ": " + (e ? e : "?");
  }
  if (lib == nullptr) {
    l.error = "cannot load cuBLAS (" + tried + ")";
    return l;
  }
  bind(lib, "cublasCreate_v2", &l.api.create, &l.error);
  bind(lib, "cublasDestroy_v2", &l.api.destroy, &l.error);
  bind(lib, "cublasSetStream_v2", &l.api.set_stream, &l.error);
  bind(lib, "cublasGemmEx", &l.api.gemm_ex, &l.error);
  return l;  // the library stays loaded for the life of the process
}

}  // namespace

const CublasApi& cublas_api() {
  static const Loaded loaded = load();
  if (!loaded.error.empty()) throw CudaError(loaded.error);
  return loaded.api;
}

}  // namespace tiermem::gpt::cuda
