// SIGINT/SIGTERM handling for the services: block the signals in every thread
// and let one thread sigwait() for them, so shutdown runs as ordinary code.
#ifndef PIPEMARE_COMMON_SIGNALS_H_
#define PIPEMARE_COMMON_SIGNALS_H_

#include <chrono>

namespace pipemare {

// Call first in main(), before any thread starts.
void BlockStopSignals();
// Once a stop is requested, the process gets `seconds` to shut down cleanly
// (draining, cutting checkpoints); past that, or at a second SIGINT/SIGTERM,
// it logs why and exits at once with status 1, whatever a thread is stuck in
// (a handler reading a file, a join). 0 (the default): no bound.
void SetStopBound(double seconds);
bool StopRequested();
// Sleeps up to `d`; returns true if a stop was requested.
bool WaitForStop(std::chrono::milliseconds d);

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_SIGNALS_H_
