#include "tests/support/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "tests/support/test_paths.h"

namespace infinigen::testing {

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
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
  for (int i = 0; i < 200 && !(PortOpen(where.host, port) && Logged(ready)); ++i) {
    int status;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

ServerProcess::~ServerProcess() { Kill(); }

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
