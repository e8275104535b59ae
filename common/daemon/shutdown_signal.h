// Graceful shutdown on SIGINT / SIGTERM for daemons: block the signals before
// any thread starts (so every thread inherits the mask), then wait for one.
#pragma once

namespace tessera {

// Blocks SIGINT and SIGTERM in the calling thread. Call first in main().
void BlockShutdownSignals();

// Waits until SIGINT or SIGTERM arrives and returns its number.
int WaitForShutdownSignal();

}  // namespace tessera
