// pipemarectl's remote commands (submit, status, list, watch, cancel,
// workers) and the helpers they share with the local launcher.
#ifndef PIPEMARE_CLIENT_COMMANDS_H_
#define PIPEMARE_CLIENT_COMMANDS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare::client {

// Exit codes.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;    // job did not succeed, RPC failed
inline constexpr int kExitBadInput = 2;  // invalid spec or arguments
inline constexpr int kExitInterrupted = 130;

// Deadline of every unary RPC, in seconds.
inline constexpr double kRpcDeadlineSeconds = 10;

enum class OutputFormat { kTable, kJson };

// Options every command takes.
struct GlobalOptions {
  std::string coordinator;  // "host:port"
  OutputFormat output = OutputFormat::kTable;
};

// A stub for the coordinator at `address` (channel made by MakeChannel).
std::unique_ptr<v1::Coordinator::Stub> ConnectCoordinator(const std::string& address);

// Prints the error for a failed RPC to stderr and returns the exit code:
// unreachable coordinators get a hint about --coordinator, other errors print
// the server's message. INVALID_ARGUMENT (a spec the coordinator refused) is
// kExitBadInput, everything else kExitFailed.
int ReportRpcError(const grpc::Status& status, const std::string& address);

// Loads a spec file, applies defaults and validates it. On error prints
// "error: <message>" and returns the error.
absl::StatusOr<v1::JobSpec> LoadValidSpec(const std::string& path);

// `text` inside a JSON string literal (quotes and control characters escaped).
std::string JsonEscape(const std::string& text);

// Prints `job` as `status` does: a table or JSON on stdout.
void PrintJobStatus(const v1::JobStatus& job, OutputFormat output);

// The commands. Each returns the process exit code.
// `from`: SubmitJobRequest.from_checkpoint (empty: from the first step).
// `init_from`: SubmitJobRequest.init_from (weights only, from step 0).
int RunSubmit(const GlobalOptions& options, const std::string& file, bool wait,
              const std::string& from = "", const std::string& init_from = "");
int RunStatus(const GlobalOptions& options, const std::string& job_id);
int RunList(const GlobalOptions& options);
int RunWatch(const GlobalOptions& options, const std::string& job_id);
int RunCancel(const GlobalOptions& options, const std::string& job_id);
int RunWorkers(const GlobalOptions& options);
// Resumes a FAILED or CANCELLED job from its newest checkpoint; with
// `wait`, follows it to its end.
int RunResume(const GlobalOptions& options, const std::string& job_id, bool wait);
// Writes the trained model of `job_id` (checkpoint after step `step`, 0: the
// newest valid one) to `out` and its spec, input normalisation and results
// to `out`.json, each atomically.
int RunExport(const GlobalOptions& options, const std::string& job_id, int64_t step,
              const std::string& out);

}  // namespace pipemare::client

#endif  // PIPEMARE_CLIENT_COMMANDS_H_
