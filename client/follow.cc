#include "client/follow.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/format.h"
#include "common/rpc.h"

namespace pipemare::client {
namespace {

std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void HandleInterrupt(int signal_number) {
  if (g_interrupted.exchange(true)) {
    // Second signal: the user insists. Die the default way.
    ::signal(signal_number, SIG_DFL);
    ::raise(signal_number);
  }
}

using Clock = std::chrono::steady_clock;

// Why the helper thread cancelled the stream.
enum class CancelCause { kNone, kInterrupted, kIdle };

}  // namespace

void InstallInterruptHandlers() {
  struct sigaction action {};
  action.sa_handler = HandleInterrupt;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

bool Interrupted() { return g_interrupted.load(); }

bool SleepUnlessInterrupted(double seconds) {
  auto end = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (Clock::now() < end) {
    if (Interrupted()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return !Interrupted();
}

FollowResult FollowJob(v1::Coordinator::StubInterface& stub, const std::string& job_id,
                       const FollowOptions& options) {
  FILE* progress_out = options.output == OutputFormat::kJson ? stderr : stdout;
  ProgressPrinter printer(progress_out, isatty(fileno(progress_out)) == 1);
  FollowResult result;
  bool seen_job = false;

  auto lost = [&](const grpc::Status& status, const std::string& context) {
    printer.Finish();
    std::fprintf(stderr, "error: lost connection to coordinator at %s: %s%s\n",
                 options.address.c_str(), context.c_str(),
                 std::string(FromGrpc(status).message()).c_str());
    result.outcome = FollowOutcome::kLostConnection;
    result.exit_code = kExitFailed;
    return result;
  };

  // Since when the coordinator has been unreachable (a restart), if it is.
  std::optional<Clock::time_point> unreachable_since;
  // A failure that a coordinator restart explains: wait and watch again
  // (true), or give up (false) once reconnect_seconds have passed.
  auto retry_after = [&](const grpc::Status& status) {
    const auto code = status.error_code();
    if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::DEADLINE_EXCEEDED &&
        code != grpc::StatusCode::CANCELLED && code != grpc::StatusCode::UNKNOWN) {
      return false;
    }
    if (!unreachable_since) {
      unreachable_since = Clock::now();
      printer.Note(
          Format("the coordinator at %s is not answering (%s); reconnecting for up to "
                 "%.0f s (the job goes on without this watch)",
                 options.address.c_str(), std::string(FromGrpc(status).message()).c_str(),
                 options.reconnect_seconds));
    }
    if (Clock::now() - *unreachable_since >
        std::chrono::milliseconds(static_cast<int64_t>(options.reconnect_seconds * 1000))) {
      return false;
    }
    return SleepUnlessInterrupted(1.0);
  };
  auto reached = [&] {
    if (unreachable_since) printer.Note("reconnected to the coordinator");
    unreachable_since.reset();
  };

  while (true) {
    // One WatchJob stream. The blocking Read runs here; a helper thread
    // cancels the call on SIGINT/SIGTERM or when the stream goes quiet, and
    // runs the caller's poll.
    grpc::ClientContext context;
    std::atomic<int64_t> last_message_ms{0};
    auto since_start_ms = [start = Clock::now()] {
      return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    };
    std::atomic<CancelCause> cause{CancelCause::kNone};
    std::mutex mu;
    std::condition_variable cv;
    bool stream_done = false;
    std::thread guard([&] {
      const int64_t idle_ms = static_cast<int64_t>(options.idle_seconds * 1000);
      auto next_poll = Clock::now();
      std::unique_lock<std::mutex> lock(mu);
      while (!cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return stream_done; })) {
        if (Interrupted()) {
          cause = CancelCause::kInterrupted;
          context.TryCancel();
          return;
        }
        if (since_start_ms() - last_message_ms.load() > idle_ms) {
          cause = CancelCause::kIdle;
          context.TryCancel();
          return;
        }
        if (options.poll && Clock::now() >= next_poll) {
          next_poll = Clock::now() + std::chrono::milliseconds(500);
          lock.unlock();
          for (const auto& note : options.poll()) printer.Note(note);
          lock.lock();
        }
      }
    });

    v1::WatchJobRequest request;
    request.set_id(job_id);
    bool got_message = false;
    std::unique_ptr<grpc::ClientReaderInterface<v1::JobEvent>> reader =
        stub.WatchJob(&context, request);
    v1::JobEvent event;
    while (reader->Read(&event)) {
      if (!got_message) reached();
      last_message_ms = since_start_ms();
      got_message = true;
      seen_job = true;
      result.job = event.job();
      printer.Update(result.job);
    }
    grpc::Status status = reader->Finish();
    {
      std::lock_guard<std::mutex> lock(mu);
      stream_done = true;
    }
    cv.notify_all();
    guard.join();

    if (cause == CancelCause::kInterrupted || Interrupted()) {
      printer.Finish();
      result.outcome = FollowOutcome::kInterrupted;
      result.exit_code = kExitInterrupted;
      return result;
    }
    if (seen_job && IsTerminal(result.job.state())) break;

    if (cause != CancelCause::kIdle && !status.ok()) {
      if (!seen_job) {
        // Never got going: unknown job, or no coordinator there at all.
        printer.Finish();
        result.outcome = FollowOutcome::kRpcError;
        result.exit_code = ReportRpcError(status, options.address);
        return result;
      }
      if (retry_after(status)) continue;
      if (Interrupted()) continue;  // reported at the top of the loop
      return lost(status, "");
    }

    // The stream went quiet, or closed before the job ended: ask directly.
    auto get_context = ContextWithDeadline(kRpcDeadlineSeconds);
    v1::GetJobRequest get;
    get.set_id(job_id);
    v1::JobStatus job;
    grpc::Status get_status = stub.GetJob(get_context.get(), get, &job);
    if (!get_status.ok()) {
      if (!seen_job && get_status.error_code() != grpc::StatusCode::UNAVAILABLE &&
          get_status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        printer.Finish();
        result.outcome = FollowOutcome::kRpcError;
        result.exit_code = ReportRpcError(get_status, options.address);
        return result;
      }
      if (seen_job && retry_after(get_status)) continue;
      if (Interrupted()) continue;
      return lost(get_status,
                  cause == CancelCause::kIdle
                      ? Format("no update for %.0f s and GetJob failed: ", options.idle_seconds)
                      : "");
    }
    reached();
    seen_job = true;
    result.job = job;
    printer.Update(job);
    if (IsTerminal(job.state())) break;
    // Still running and the coordinator answers: watch again. Pause briefly
    // when the stream closed on its own, so a misbehaving server cannot make
    // us spin.
    if (!got_message) SleepUnlessInterrupted(1.0);
  }

  printer.Finish();
  result.outcome = FollowOutcome::kEnded;
  result.exit_code = result.job.state() == v1::SUCCEEDED ? kExitOk : kExitFailed;
  if (options.print_summary) {
    if (options.output == OutputFormat::kJson) {
      std::fputs(ToJson(result.job).c_str(), stdout);
    } else {
      std::printf("%s\n", RenderFinalState(result.job).c_str());
      std::string epochs = RenderEpochTable(result.job);
      if (!epochs.empty()) std::printf("\n%s", epochs.c_str());
    }
    std::fflush(stdout);
  }
  return result;
}

}  // namespace pipemare::client
