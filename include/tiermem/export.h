// tiermem/export.h — TIERMEM_API marks the public API: the types and functions declared in
// include/tiermem/ outside namespace tiermem::detail. The libraries are compiled with hidden
// visibility (cmake/tiermem_helpers.cmake), so a shared libtiermem.so exports only what carries
// TIERMEM_API; TIERMEM_LOCAL keeps a member type of an exported class (a pimpl's Impl) hidden.
// In a static build the marks change nothing. GCC and Clang only (the project builds with no other).
#pragma once

#define TIERMEM_API __attribute__((visibility("default")))
#define TIERMEM_LOCAL __attribute__((visibility("hidden")))
