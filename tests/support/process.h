// Real server processes for integration tests: start a built binary with flags, wait until it
// is ready, kill or terminate it. Ports are picked free on 127.0.0.1. A process may run in a
// network namespace (tests/support/netns.h) and be waited for at its address there.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace infinigen::testing {

int FreePort();

// Where a server process runs: its network namespace ("": this process's), the address the
// test reaches it at, and environment variables set for it alone.
struct Placement {
  std::string netns;
  std::string host = "127.0.0.1";
  std::vector<std::pair<std::string, std::string>> env;
};

class ServerProcess {
 public:
  // Starts build/bin/<binary> with `args`; waits up to 30 s for 127.0.0.1:port to accept and
  // the log to hold `ready` (every server of the project writes ": serving " once it is ready;
  // the worker's port opens before its model is loaded; "" waits for the port only).
  ServerProcess(const std::string& binary, std::vector<std::string> args, int port,
                const std::string& ready = ": serving ");
  // The same, placed: in `where.netns`, waited for at where.host:port.
  ServerProcess(const std::string& binary, std::vector<std::string> args, int port,
                const Placement& where, const std::string& ready = ": serving ");
  // Whether the log holds `text`.
  bool Logged(const std::string& text) const;
  ~ServerProcess();
  bool running() const { return pid_ > 0; }
  int port() const { return port_; }
  void Kill();                   // SIGKILL, reaped
  void Signal(int sig);          // e.g. SIGSTOP / SIGCONT
  int Terminate(int timeout_s);  // SIGTERM; the exit status, or -1 if it did not exit in time
  const std::string& log_path() const { return log_; }

 private:
  pid_t pid_ = -1;
  int port_;
  std::string log_;
};

}  // namespace infinigen::testing
