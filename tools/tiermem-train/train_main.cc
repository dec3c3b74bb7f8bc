// tiermem-train — trains a GPT whose parameters and optimizer state do not fit the device,
// paging them through pinned host memory and NVMe (ZeRO stage 3 over tiermem's TensorStore).
//
// Build and run (from the repository root):
//   cmake --preset default && cmake --build --preset default --target tiermem-train
//   build/default/bin/tiermem-train              # the demo: `mini` on the fortunes
//                                                         # corpus, ZeRO-3, params + Adam on NVMe
//   build/default/bin/tiermem-train --help
//   build/default/bin/tiermem-train --data my.txt --steps 500 --save ckpt
//   build/default/bin/tiermem-train --resume ckpt --steps 1000
//   build/default/bin/tiermem-train --config ds_config.json --json --trace t.json
//   mpirun -np 2 build/default/bin/tiermem-train --batch 4
//
// What it does, in order (train_loop.cc): parse the command line (train_options.cc), merge it
// with the DeepSpeed-style --config, load and check the data before anything else
// (data.cc), build the engine that holds parameters, gradients and optimizer state in their
// tiers (train_engines.cc), resume from a checkpoint if asked (checkpoint.cc), then train:
// each step runs the model module by module, acquiring each module's parameters just before it
// runs and releasing them after, accumulates gradients over micro-batches and steps AdamW;
// progress per step, held-out loss every --eval-every steps, a summary at the end.
// Exit codes: 0 done, 1 an error during the run (one line on stderr), 2 a bad command line or
// --config file (one line on stderr, naming the option or config key), 130 / 143 stopped by
// SIGINT / SIGTERM (and by a closed stdout: `tiermem-train | head -3` stops like SIGTERM).
#include <signal.h>
#include <unistd.h>


#include "gpt/kernels_cpu.h"
#include "tiermem/env.h"
#include "train/train_loop.h"
#include "train/train_options.h"

namespace {

// stdout closed by its reader (`| head`): stop as SIGTERM does — after the step in flight, with
// the summary, the swap files and locks removed — instead of dying of SIGPIPE and leaving them.
// The step loop's SIGTERM handler (train_loop.cc) does the stopping; before it is installed (or
// after it has fired once) the signal is dropped and the write fails with EPIPE, which the
// reporter ignores, so the next write after the loop starts stops the run.
extern "C" void on_sigpipe(int) {
  struct sigaction term {};
  if (::sigaction(SIGTERM, nullptr, &term) == 0 && term.sa_handler != SIG_DFL &&
      term.sa_handler != SIG_IGN) {
    ::kill(::getpid(), SIGTERM);
  }
}

void stop_on_closed_stdout() {
  struct sigaction sa {};
  sa.sa_handler = on_sigpipe;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGPIPE, &sa, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  // Variables read when OpenBLAS and libgomp load: its generic kernels on a CPU it does not know
  // (gpt/kernels_cpu.h), the idle spin of its threads and of libgomp's (kernels_cpu.h, env.h); one
  // restart sets them all.
  const bool blas = tiermem::gpt::cpu::prefer_openblas_core_for_this_cpu();
  const bool idle = tiermem::gpt::cpu::prefer_idle_openblas_threads();
  tiermem::prefer_passive_omp_wait(argv, blas || idle);
  stop_on_closed_stdout();
  tiermem::train::TrainOptions opts;
  const int rc = tiermem::train::parse_train_options(argc, argv, &opts);
  if (rc >= 0) return rc;
  return tiermem::train::run_training(opts);
}
