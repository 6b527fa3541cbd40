#include "common/signals.h"

#include <csignal>
#include <cstdlib>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"

namespace pipemare {
namespace {
ABSL_CONST_INIT absl::Mutex mu(absl::kConstInit);
bool stop ABSL_GUARDED_BY(mu) = false;
double bound_seconds ABSL_GUARDED_BY(mu) = 0;

[[noreturn]] void ExitNow(const std::string& why) {
  LogError(absl::StrCat("exiting now: ", why));
  std::_Exit(1);
}
}  // namespace

void BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    int sig = 0;
    sigwait(&set, &sig);
    double bound = 0;
    {
      absl::MutexLock lock(&mu);
      stop = true;
      bound = bound_seconds;
    }
    if (bound > 0) {
      std::thread([bound] {
        std::this_thread::sleep_for(std::chrono::duration<double>(bound));
        ExitNow(absl::StrCat("did not stop within ", bound, " s of the signal"));
      }).detach();
    }
    sigwait(&set, &sig);
    ExitNow("a second stop signal");
  }).detach();
}

void SetStopBound(double seconds) {
  absl::MutexLock lock(&mu);
  bound_seconds = seconds;
}

bool StopRequested() {
  absl::MutexLock lock(&mu);
  return stop;
}

bool WaitForStop(std::chrono::milliseconds d) {
  absl::MutexLock lock(&mu);
  return mu.AwaitWithTimeout(absl::Condition(&stop), absl::FromChrono(d));
}

}  // namespace pipemare
