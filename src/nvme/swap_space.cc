#include "tiermem/swap_space.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
namespace tiermem {
SwapSpaceOptions SwapSpaceOptions::from_config(const Config& c) {
  SwapSpaceOptions o;
  o.stripe_bytes = c.tiermem.stripe_bytes;
  o.initial_bytes_per_path = c.tiermem.swap_initial_bytes;
  o.max_bytes_per_path = c.tiermem.swap_max_bytes;
  o.checksum = c.tiermem.checksum;
  return o;
}
struct SwapSpace::PathState {};
SwapSpace::SwapSpace(const SwapSpaceOptions& o, std::vector<std::string> d, IoEngine& e)
    : options_(o), dirs_(std::move(d)), engine_(e) {
  throw NotSupportedError("SwapSpace: not implemented yet");
}
SwapSpace::SwapSpace(const Config& c, std::vector<std::string> d, IoEngine& e)
    : SwapSpace(SwapSpaceOptions::from_config(c), std::move(d), e) {}
SwapSpace::~SwapSpace() = default;
SwapExtent SwapSpace::allocate(std::uint64_t) { throw NotSupportedError("SwapSpace stub"); }
void SwapSpace::free(const SwapExtent&) {}
IoRequest SwapSpace::write(const SwapExtent&, const void*, std::uint64_t) { throw NotSupportedError("SwapSpace stub"); }
IoRequest SwapSpace::read(const SwapExtent&, void*, std::uint64_t) { throw NotSupportedError("SwapSpace stub"); }
const std::string& SwapSpace::file_path(std::uint32_t i) const { return dirs_.at(i); }
SwapStats SwapSpace::stats() const { return {}; }
}  // namespace tiermem
