#include "common/shutdown_signal.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>

namespace infinigen {
namespace {

// The self-pipe: the handler writes one byte, the waiter reads it (both ends non-blocking).
// write(2) is async-signal-safe, unlike waking a condition variable or an absl::Notification
// from inside a handler.
int g_pipe[2] = {-1, -1};

void OnSignal(int) {
  const int saved_errno = errno;  // the interrupted code may be reading errno
  const char byte = 1;
  // Non-blocking: a flood of signals that fills the pipe drops bytes instead of blocking here.
  [[maybe_unused]] const ssize_t ignored = write(g_pipe[1], &byte, 1);
  errno = saved_errno;
}

}  // namespace

void InstallShutdownSignalHandlers() {
  static const bool installed = [] {
    if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      std::perror("shutdown signal pipe");
      std::abort();
    }
    struct sigaction action = {};
    action.sa_handler = OnSignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;  // other threads' interrupted system calls resume
    sigaction(SIGTERM, &action, nullptr);
    sigaction(SIGINT, &action, nullptr);
    return true;
  }();
  (void)installed;
}

void WaitForShutdownSignal() {
  InstallShutdownSignalHandlers();
  pollfd ready{g_pipe[0], POLLIN, 0};
  for (;;) {
    // Woken by the handler's byte at once; the timeout is for ThreadSanitizer, which runs a
    // handler only when the thread it interrupted leaves the intercepted call it is in: a
    // signal that lands on this thread while it waits would otherwise wait for itself.
    const int n = poll(&ready, 1, 100);
    char byte = 0;
    if (n > 0 && read(g_pipe[0], &byte, 1) == 1) return;
    if (n < 0 && errno != EINTR) {
      std::perror("shutdown signal pipe");
      std::abort();
    }
  }
}

}  // namespace infinigen
