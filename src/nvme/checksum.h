// src/nvme/checksum.h — the hash SwapSpace keeps per extent: XXH3-64 (seed 0) from libxxhash.
//
// extent_checksum() picks, once, the fastest build of the same function this CPU runs: an AVX2
// build of XXH3 (checksum_avx2.cc, compiled with -mavx2, ~2-4x the SSE2 build libxxhash ships on
// x86-64) when cpuid says AVX2, else libxxhash's. Both give the same value for the same bytes
// (XXH3's result does not depend on the vector width); checksum_test compares them.
//
// Thread-safety: pure functions of their arguments; callable from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tiermem::detail {

// XXH3-64 of [data, data + bytes), seed 0, with the fastest implementation available.
std::uint64_t extent_checksum(const void* data, std::size_t bytes) noexcept;
// libxxhash's XXH3_64bits (the obvious twin).
std::uint64_t extent_checksum_portable(const void* data, std::size_t bytes) noexcept;
// The AVX2 build; only call it when extent_checksum_has_avx2() is true.
std::uint64_t extent_checksum_avx2(const void* data, std::size_t bytes) noexcept;
// True when this CPU runs the AVX2 build.
bool extent_checksum_has_avx2() noexcept;

}  // namespace tiermem::detail
