#include "common/shutdown_signal.h"

#include <csignal>

#include "absl/synchronization/notification.h"

namespace infinigen {
namespace {

absl::Notification* g_stop = nullptr;

void OnSignal(int) {
  if (g_stop != nullptr && !g_stop->HasBeenNotified()) g_stop->Notify();
}

}  // namespace

void WaitForShutdownSignal() {
  static absl::Notification stop;
  g_stop = &stop;
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  stop.WaitForNotification();
}

}  // namespace infinigen
