// Following a job to its end over the WatchJob stream, shared by `watch`,
// `submit --wait` and `local`; plus SIGINT/SIGTERM handling.
#ifndef PIPEMARE_CLIENT_FOLLOW_H_
#define PIPEMARE_CLIENT_FOLLOW_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>
#include <vector>

#include "client/commands.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare::client {

// Installs SIGINT/SIGTERM handlers that set a flag (see Interrupted()). A
// second signal while the flag is set kills the process the default way.
void InstallInterruptHandlers();
// True once SIGINT or SIGTERM arrived after InstallInterruptHandlers().
bool Interrupted();
// Sleeps up to `seconds`, returning early (false) when interrupted.
bool SleepUnlessInterrupted(double seconds);

struct FollowOptions {
  std::string address;  // the coordinator, for messages
  OutputFormat output = OutputFormat::kTable;
  // After the job ends: print the final state line, reason and epoch table
  // (table output) or the final JobStatus (JSON output) on stdout.
  bool print_summary = true;
  // With no message on the stream for this long, ask GetJob whether the
  // coordinator is still there.
  double idle_seconds = 60;
  // When the coordinator cannot be reached after the job was seen (it
  // restarts: a SIGTERM drain or a crash), keep trying for this long before
  // giving up; the job goes on without the watcher.
  double reconnect_seconds = 300;
  // Called about every 0.5 s from a helper thread while following; each
  // returned line is printed on stderr as a note.
  std::function<std::vector<std::string>()> poll;
};

enum class FollowOutcome {
  kEnded,           // the job reached a terminal state; see `job`
  kInterrupted,     // SIGINT/SIGTERM
  kLostConnection,  // the coordinator went away mid-stream (error printed)
  kRpcError,        // the watch could not start, e.g. unknown job (error printed)
};

struct FollowResult {
  FollowOutcome outcome = FollowOutcome::kRpcError;
  v1::JobStatus job;            // the last status seen
  int exit_code = kExitFailed;  // what the command should exit with
};

// Follows job `job_id` until it ends, showing progress: a live line on a
// terminal, plain lines otherwise (on stdout for table output, stderr for
// JSON output so that stdout stays one JSON document).
FollowResult FollowJob(v1::Coordinator::StubInterface& stub, const std::string& job_id,
                       const FollowOptions& options);

}  // namespace pipemare::client

#endif  // PIPEMARE_CLIENT_FOLLOW_H_
