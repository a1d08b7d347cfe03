// infinigen: the command-line entry point. `infinigen <command> --help` describes each command.
#include <cstring>
#include <iostream>
#include <string>

#include "cli/commands.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int, char**);
};

constexpr Command kCommands[] = {
    {"bench", "measure prefill and decode throughput and peak memory", infinigen::cli::RunBench},
#if INFINIGEN_HAVE_SERVICES
    {"client", "generate through a server's public API (router or serve)",
     infinigen::cli::RunClient},
#endif
    {"eval", "accuracy of KV selection policies against dense attention", infinigen::cli::RunEval},
    {"generate", "generate a continuation of a prompt on the CPU", infinigen::cli::RunGenerate},
#if INFINIGEN_HAVE_SERVICES
    {"load", "drive N concurrent streams against a server for T seconds", infinigen::cli::RunLoad},
#endif
    {"logits", "write the model's logits for a token sequence to a .npy file",
     infinigen::cli::RunLogits},
    {"prepare", "compute a model's InfiniGen skew and partial channels (sidecar)",
     infinigen::cli::RunPrepare},
#if INFINIGEN_HAVE_SERVICES
    {"serve", "serve the public API: router, worker and KV store in one process",
     infinigen::cli::RunServe},
#endif
    {"tokenize", "text to token ids and back, with any supported tokenizer",
     infinigen::cli::RunTokenize},
};

void PrintUsage(std::ostream& out) {
  out << "usage: infinigen <command> [flags]\n\ncommands:\n";
  for (const Command& c : kCommands) {
    out << "  " << c.name << std::string(12 - std::strlen(c.name), ' ') << c.summary << "\n";
  }
  out << "\n`infinigen <command> --help` lists a command's flags.\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    PrintUsage(std::cerr);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    PrintUsage(std::cout);
    return 0;
  }
  for (const Command& c : kCommands) {
    if (name == c.name) return c.run(argc - 2, argv + 2);
  }
  std::cerr << "infinigen: unknown command '" << name << "' (see infinigen --help)\n";
  return 2;
}
