// The subcommands of the `infinigen` binary. Each takes the arguments after its name and
// returns the process exit code (0 ok, 1 runtime failure, 2 bad command line or input).
#pragma once

namespace infinigen::cli {

int RunBench(int argc, char** argv);
int RunEval(int argc, char** argv);
int RunGenerate(int argc, char** argv);
int RunLogits(int argc, char** argv);
int RunPrepare(int argc, char** argv);
int RunTokenize(int argc, char** argv);
// With the services (INFINIGEN_HAVE_SERVICES) only:
int RunClient(int argc, char** argv);
int RunLoad(int argc, char** argv);
int RunServe(int argc, char** argv);

}  // namespace infinigen::cli
