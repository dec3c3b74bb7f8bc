#include "nvme/engine_internal.h"
#include "tiermem/error.h"
namespace tiermem::detail {
std::unique_ptr<IoEngine> make_uring_engine(const IoEngineOptions&) {
  throw NotSupportedError("io_uring engine: not implemented yet");
}
}  // namespace tiermem::detail
