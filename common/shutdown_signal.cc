#include "common/shutdown_signal.h"

#include <csignal>

#include "absl/synchronization/notification.h"

namespace infinigen {
namespace {

absl::Notification* g_stop = nullptr;

void OnSignal(int) {
  if (g_stop != nullptr && !g_stop->HasBeenNotified()) g_stop->Notify();
}

absl::Notification& Stop() {
  static absl::Notification stop;
  return stop;
}

}  // namespace

void InstallShutdownSignalHandlers() {
  static const bool installed = [] {
    g_stop = &Stop();
    std::signal(SIGTERM, OnSignal);
    std::signal(SIGINT, OnSignal);
    return true;
  }();
  (void)installed;
}

void WaitForShutdownSignal() {
  InstallShutdownSignalHandlers();
  Stop().WaitForNotification();
}

}  // namespace infinigen
