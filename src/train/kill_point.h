// src/train/kill_point.h — TEST-ONLY crash injection for tiermem-train (tests/fault's crash
// loop). Never set in production: with TIERMEM_TEST_KILL_AT unset every kill_point() is a no-op.
//
// TIERMEM_TEST_KILL_AT=<phase>:<n> makes the n-th (1-based) call of kill_point("<phase>") in this
// process raise SIGKILL on itself — no cleanup, no flush, exactly like a power cut of the process.
// The phases tiermem-train has (where the call sits):
//   step          start of an optimizer step (train_loop.cc), before its forward pass
//   optimizer     after one module's AdamW update inside the step, before the next module's
//                 (train_engine_store.cc): parameters and moments half-updated, dirty in host
//   swap-out      the store engine saw bytes written to NVMe grow (a watcher thread polling
//                 TensorStore::stats() every 50 us), i.e. while write-backs are in flight
//   ckpt-tensor   after a tensor was written to the temporary state file (checkpoint.cc)
//   ckpt-state    after the state file was fsynced and renamed, before the manifest is written
//   ckpt-manifest after the manifest's temporary file was fsynced, before its rename
//   ckpt-gc       after the manifest rename and directory fsync, before old state files go
//   init          after the SIGINT/SIGTERM handlers are installed, before the engine writes the
//                 initial state (train_loop.cc)
// TIERMEM_TEST_TERM_AT=<phase>:<n> sends SIGTERM instead (a user's Ctrl-C or `kill` at that
// point: the run must stop cleanly). A malformed value is reported once on stderr and ignored.
//
// Thread-safety: thread-safe (the counter is atomic).
#pragma once

namespace tiermem::train {

// Counts a pass through `phase`; raises SIGKILL when TIERMEM_TEST_KILL_AT names this pass.
void kill_point(const char* phase);

// True when TIERMEM_TEST_KILL_AT names `phase` (so a caller can skip setting up a watcher).
bool kill_point_armed(const char* phase);

}  // namespace tiermem::train
