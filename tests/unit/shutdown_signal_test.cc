// The services' shutdown trigger (common/shutdown_signal.h): a SIGTERM or SIGINT, whether it
// comes before the wait, during it, or in a flood, ends the wait and nothing else.
#include "common/shutdown_signal.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "gtest/gtest.h"

namespace infinigen {
namespace {

// Starts a wait on a detached thread; the future is ready when it ends, and `id` (when given)
// receives the thread's id. Detached, so that a wait that never ends fails the test instead of
// hanging it (the thread is left behind; the process exits anyway).
std::future<void> StartWaiting(pthread_t* id = nullptr) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> ended = done->get_future();
  std::thread waiter([done] {
    WaitForShutdownSignal();
    done->set_value();
  });
  if (id != nullptr) *id = waiter.native_handle();
  waiter.detach();
  return ended;
}

TEST(ShutdownSignal, SignalBeforeTheWaitEndsItAtOnce) {
  InstallShutdownSignalHandlers();
  ASSERT_EQ(raise(SIGTERM), 0);  // handled now, on this thread: the default action would kill us
  EXPECT_EQ(StartWaiting().wait_for(std::chrono::seconds(10)), std::future_status::ready);
}

TEST(ShutdownSignal, SignalToTheProcessWakesTheWaiter) {
  InstallShutdownSignalHandlers();
  std::future<void> ended = StartWaiting();
  // Not yet: no signal has come since the last wait took its own.
  EXPECT_EQ(ended.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  ASSERT_EQ(kill(getpid(), SIGINT), 0);
  EXPECT_EQ(ended.wait_for(std::chrono::seconds(10)), std::future_status::ready);
}

// The signal lands on the waiting thread itself, in the middle of its wait. (Under
// ThreadSanitizer a handler runs only when the interrupted thread leaves its intercepted call: a
// wait blocked in read(2) never left it, so it waited for its own handler's byte; the services'
// SIGTERM drains failed so in CI's TSan stage.)
TEST(ShutdownSignal, SignalToTheWaitingThreadItselfEndsTheWait) {
  InstallShutdownSignalHandlers();
  pthread_t id;
  std::future<void> ended = StartWaiting(&id);
  // Still waiting (so the thread exists for pthread_kill: it has not returned).
  ASSERT_EQ(ended.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  ASSERT_EQ(pthread_kill(id, SIGTERM), 0);
  EXPECT_EQ(ended.wait_for(std::chrono::seconds(10)), std::future_status::ready);
}

// More signals than the pipe holds bytes: the handler must neither block (it runs on whichever
// thread the kernel picks, here the raising one) nor lose the wake-up. In a child process, so
// that a handler that blocks fails the test instead of hanging it (a blocked handler would also
// swallow the SIGTERM a timeout sends).
TEST(ShutdownSignal, AFloodOfSignalsNeitherBlocksTheHandlerNorLosesTheWakeUp) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    InstallShutdownSignalHandlers();
    for (int i = 0; i < 200000; ++i) raise(i % 2 == 0 ? SIGTERM : SIGINT);
    WaitForShutdownSignal();
    _exit(0);
  }
  int status = 0;
  pid_t ended = 0;
  for (int tries = 0; tries < 1000 && ended == 0; ++tries) {
    ended = waitpid(child, &status, WNOHANG);
    if (ended == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (ended == 0) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the flood of signals did not end within 10 s: the handler blocked";
  }
  ASSERT_EQ(ended, child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

}  // namespace
}  // namespace infinigen
