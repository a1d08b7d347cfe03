// The services' shutdown trigger: blocks until SIGTERM or SIGINT arrives.
#pragma once

namespace infinigen {

// Installs SIGTERM and SIGINT handlers (once) and waits for either.
void WaitForShutdownSignal();

}  // namespace infinigen
