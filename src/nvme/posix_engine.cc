#include "nvme/engine_internal.h"
#include "tiermem/error.h"
namespace tiermem::detail {
std::unique_ptr<IoEngine> make_posix_engine(const IoEngineOptions&) {
  throw NotSupportedError("posix engine: not implemented yet");
}
}  // namespace tiermem::detail
