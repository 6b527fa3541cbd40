// Event logs: one line per event, on stderr, with time (UTC), level and, when
// the event concerns one, the job and the stage. Two formats:
//   text: 2026-12-02T21:00:00.123Z INFO job=job-1 stage=2 loaded stage
//   json:
//   {"time":"2026-12-02T21:00:00.123Z","level":"info","job_id":"job-1","stage":2,"msg":"loaded
//   stage"}
// Both services take --log-format text|json. Backed by spdlog.
#ifndef PIPEMARE_COMMON_LOG_H_
#define PIPEMARE_COMMON_LOG_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace pipemare {

enum class LogLevel { kInfo, kWarning, kError };

// What an event concerns; empty job_id / negative stage = not applicable.
struct LogContext {
  std::string job_id;
  int stage = -1;
};
inline LogContext ForJob(std::string job_id) { return LogContext{std::move(job_id), -1}; }
inline LogContext ForStage(std::string job_id, int stage) {
  return LogContext{std::move(job_id), stage};
}

// "text" | "json"; INVALID_ARGUMENT naming `flag` otherwise. Call once, early.
absl::Status InitLogging(const std::string& format, const std::string& flag = "--log-format");

// Formats one event line without the time (for tests): the part after the
// timestamp in text, the fields after "time" in JSON.
std::string FormatLogEvent(bool json, LogLevel level, const LogContext& context,
                           std::string_view message);

void Log(LogLevel level, const LogContext& context, std::string_view message);
inline void LogInfo(const LogContext& c, std::string_view m) { Log(LogLevel::kInfo, c, m); }
inline void LogInfo(std::string_view m) { Log(LogLevel::kInfo, {}, m); }
inline void LogWarning(const LogContext& c, std::string_view m) { Log(LogLevel::kWarning, c, m); }
inline void LogWarning(std::string_view m) { Log(LogLevel::kWarning, {}, m); }
inline void LogError(const LogContext& c, std::string_view m) { Log(LogLevel::kError, c, m); }
inline void LogError(std::string_view m) { Log(LogLevel::kError, {}, m); }

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_LOG_H_
