#include "tests/support/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"
#include "tests/support/test_paths.h"

namespace infinigen::testing {

// A port no server of this machine listens on, outside the kernel's ephemeral range: a port from
// that range (what binding port 0 hands out) can be taken by any outgoing connection between the
// test picking it and its server binding it, and was (a router's metrics port, "Address already
// in use", in a CI run with tests in parallel). Random below the range, checked free on every
// interface, never the same twice in one test process.
int FreePort() {
  static std::mutex mu;
  static std::set<int> given;
  static std::mt19937 rng(
      static_cast<unsigned>(::getpid()) * 2654435761u ^
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  const int first = 10000, last = std::max(first + 1000, low) - 1;
  std::lock_guard<std::mutex> lock(mu);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = first + static_cast<int>(rng() % static_cast<unsigned>(last - first + 1));
    if (given.count(port) != 0) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (free) {
      given.insert(port);
      return port;
    }
  }
  std::abort();  // no free port in 1000 tries: the machine is out of ports
}

static bool PortOpen(const std::string& host, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

ServerProcess::ServerProcess(const std::string& binary, std::vector<std::string> args, int port,
                             const std::string& ready)
    : ServerProcess(binary, std::move(args), port, Placement{}, ready) {}

ServerProcess::ServerProcess(const std::string& binary, std::vector<std::string> args, int port,
                             const Placement& where, const std::string& ready)
    : port_(port) {
  log_ = ::testing::TempDir() + "/" + binary + "_" +
         (where.netns.empty() ? "" : where.netns + "_") + std::to_string(port) + ".log";
  const std::string path = BinaryPath(binary);
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(path.c_str()));
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_ = ::fork();
  if (pid_ == 0) {
    const int out = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(out, 2);
    for (const auto& [name, value] : where.env) ::setenv(name.c_str(), value.c_str(), 1);
    if (!where.netns.empty()) {
      // `ip netns exec` also mounts the namespace's own /sys, where UCX looks for devices.
      std::vector<char*> wrapped = {const_cast<char*>("ip"), const_cast<char*>("netns"),
                                    const_cast<char*>("exec"),
                                    const_cast<char*>(where.netns.c_str())};
      wrapped.insert(wrapped.end(), argv.begin(), argv.end());
      ::execvp("ip", wrapped.data());
      ::_exit(127);
    }
    ::execv(path.c_str(), argv.data());
    ::_exit(127);
  }
  // Up to 30 s: a sanitized server on a loaded 2-core machine took over 10 s to load a fixture
  // (WorkerProcess.AKvPoolKeepsEachSequenceWithinItsShare under ASan, CI of 2026-12-01).
  for (int i = 0; i < 600 && !(PortOpen(where.host, port) && Logged(ready)); ++i) {
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

ServerProcess::~ServerProcess() {
  Kill();
  // A sanitized build's server reports to its log and goes on (or exits); either way the test
  // that ran it fails, naming the log.
  for (const char* report : {"WARNING: ThreadSanitizer:", "ERROR: AddressSanitizer:",
                             "ERROR: LeakSanitizer:", ": runtime error: "}) {
    if (Logged(report)) ADD_FAILURE() << "a sanitizer report (" << report << ") in " << log_;
  }
}

bool ServerProcess::Logged(const std::string& text) const {
  std::ifstream in(log_);
  std::stringstream all;
  all << in.rdbuf();
  return all.str().find(text) != std::string::npos;
}

void ServerProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

void ServerProcess::Signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

int ServerProcess::Terminate(int timeout_s) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < timeout_s * 20; ++i) {
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

}  // namespace infinigen::testing
