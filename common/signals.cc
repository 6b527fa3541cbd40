#include "common/signals.h"

#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pipemare {
namespace {
std::mutex mu;
std::condition_variable cv;
bool stop = false;
double bound_seconds = 0;  // GUARDED_BY(mu)

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
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
      bound = bound_seconds;
    }
    cv.notify_all();
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
  std::lock_guard<std::mutex> lock(mu);
  bound_seconds = seconds;
}

bool StopRequested() {
  std::lock_guard<std::mutex> lock(mu);
  return stop;
}

bool WaitForStop(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(mu);
  return cv.wait_for(lock, d, [] { return stop; });
}

}  // namespace pipemare
