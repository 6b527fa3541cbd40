// SIGINT/SIGTERM handling for the services: block the signals in every thread
// and let one thread sigwait() for them, so shutdown runs as ordinary code.
#ifndef PIPEMARE_COMMON_SIGNALS_H_
#define PIPEMARE_COMMON_SIGNALS_H_

#include <chrono>

namespace pipemare {

// Call first in main(), before any thread starts.
void BlockStopSignals();
bool StopRequested();
// Sleeps up to `d`; returns true if a stop was requested.
bool WaitForStop(std::chrono::milliseconds d);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_SIGNALS_H_
