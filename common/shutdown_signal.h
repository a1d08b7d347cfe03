// The services' shutdown trigger: blocks until SIGTERM or SIGINT arrives.
#pragma once

namespace infinigen {

// Installs the SIGTERM and SIGINT handlers (once; later calls do nothing). A handler only writes
// a byte to a pipe (async-signal-safe); the wait reads it. A service calls this before it says it
// is serving: a signal that arrives before the handlers would end the process with the signal's
// default action, not a drain.
void InstallShutdownSignalHandlers();

// Installs the handlers if not yet done and waits for either signal (one that arrived since
// they were installed returns at once).
void WaitForShutdownSignal();

}  // namespace infinigen
