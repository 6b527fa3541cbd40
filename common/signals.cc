#include "common/signals.h"

#include <condition_variable>
#include <csignal>
#include <mutex>
#include <thread>

namespace pipemare {
namespace {
std::mutex mu;
std::condition_variable cv;
bool stop = false;
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
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
  }).detach();
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
