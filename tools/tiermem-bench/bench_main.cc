// tools/tiermem-bench/bench_main.cc — tiermem-bench: measure each tier and tier pair, fio-style.
// The subcommands are bench/bench_<name>.cc; this main lists and dispatches them.
//
//   cmake --preset default && cmake --build --preset default
//   build/default/bin/tiermem-bench --help
//   build/default/bin/tiermem-bench nvme --path /mnt/nvme --rw read --bs 1M --qd 16 --json
//
// Every subcommand prints a human summary; with --json the last line printed is one JSON object.
#include <iostream>
#include <string>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "gpt/kernels_cpu.h"
#include "tiermem/env.h"
#include "tiermem/error.h"

namespace tiermem::bench {
std::vector<CommandInfo>& commands() {
  static std::vector<CommandInfo> c;
  return c;
}
}  // namespace tiermem::bench

int main(int argc, char** argv) {
  // Measure as tiermem-train runs: OpenBLAS's kernels for this CPU, passive OpenMP waits.
  const bool blas = tiermem::gpt::cpu::prefer_openblas_core_for_this_cpu();
  const bool idle = tiermem::gpt::cpu::prefer_idle_openblas_threads();
  tiermem::prefer_passive_omp_wait(argv, blas || idle);
  CLI::App app{"tiermem-bench: benchmarks of tiermem's tiers (nvme, host, device) and kernels"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, std::function<int()>>> runs;
  auto& cmds = tiermem::bench::commands();
  std::sort(cmds.begin(), cmds.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.description);
    runs.emplace_back(sub, c.setup(*sub));
  }
  // An unknown first word is named as such (CLI11 would only say a subcommand is required).
  if (argc > 1 && argv[1][0] != '-') {
    const std::string word = argv[1];
    bool known = false;
    for (const auto& c : cmds) known |= c.name == word;
    if (!known) {
      std::string names;
      for (const auto& c : cmds) names += (names.empty() ? "" : ", ") + c.name;
      std::cerr << "tiermem-bench: error: unknown subcommand '" << word << "' (one of: " << names
                << "; see --help)\n";
      return 2;
    }
  }
  app.name("tiermem-bench");  // the usage line names the tool, not the path it was run by
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // One line, as tiermem-train's and tiermem-plan's errors: the tool, the option and the value.
    std::string help = "tiermem-bench --help";
    for (auto& [sub, run] : runs) {
      if (sub->parsed()) help = "tiermem-bench " + sub->get_name() + " --help";
    }
    std::cerr << "tiermem-bench: error: " << tiermem::cli::parse_error_text(e) << " (see " << help << ")\n";
    return 2;
  }
  try {
    for (auto& [sub, run] : runs) {
      if (sub->parsed()) return run();
    }
  } catch (const tiermem::ConfigError& e) {  // bad input: exit 2, as a parse error
    const std::string msg = e.what();
    std::cerr << "tiermem-bench: error: "
              << (msg.find(e.key_path()) == std::string::npos ? e.key_path() + " = " + e.value() + ": " : "")
              << msg << "\n";
    return 2;
  } catch (const tiermem::Error& e) {
    std::cerr << "tiermem-bench: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "tiermem-bench: error: " << e.what() << "\n";
    return 1;
  }
  return 2;
}
