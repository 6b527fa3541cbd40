#include "common/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <memory>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace pipemare {
namespace {

std::atomic<bool> g_json{false};

std::shared_ptr<spdlog::logger> Logger() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = std::make_shared<spdlog::logger>("pipemare",
                                              std::make_shared<spdlog::sinks::stderr_sink_mt>());
    l->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %v", spdlog::pattern_time_type::utc);
    l->flush_on(spdlog::level::info);
    return l;
  }();
  return logger;
}

std::string JsonString(std::string_view s) {
  return nlohmann::json(std::string(s))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

absl::Status InitLogging(const std::string& format, const std::string& flag) {
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat(flag, " ", format, ": expected text or json"));
  }
  g_json = format == "json";
  if (g_json) {
    Logger()->set_pattern("{\"time\":\"%Y-%m-%dT%H:%M:%S.%eZ\",%v}",
                          spdlog::pattern_time_type::utc);
  } else {
    Logger()->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %v", spdlog::pattern_time_type::utc);
  }
  return absl::OkStatus();
}

std::string FormatLogEvent(bool json, LogLevel level, const LogContext& context,
                           std::string_view message) {
  static constexpr const char* kText[] = {"INFO", "WARN", "ERROR"};
  static constexpr const char* kJson[] = {"info", "warning", "error"};
  const int l = static_cast<int>(level);
  std::string line;
  if (json) {
    absl::StrAppend(&line, "\"level\":\"", kJson[l], "\"");
    if (!context.job_id.empty()) absl::StrAppend(&line, ",\"job_id\":", JsonString(context.job_id));
    if (context.stage >= 0) absl::StrAppend(&line, ",\"stage\":", context.stage);
    absl::StrAppend(&line, ",\"msg\":", JsonString(message));
  } else {
    absl::StrAppend(&line, kText[l]);
    if (!context.job_id.empty()) absl::StrAppend(&line, " job=", context.job_id);
    if (context.stage >= 0) absl::StrAppend(&line, " stage=", context.stage);
    // One event, one line: newlines inside a message would split it.
    std::string flat(message);
    for (char& c : flat) {
      if (c == '\n' || c == '\r') c = ' ';
    }
    absl::StrAppend(&line, " ", flat);
  }
  return line;
}

void Log(LogLevel level, const LogContext& context, std::string_view message) {
  static constexpr spdlog::level::level_enum kLevel[] = {spdlog::level::info, spdlog::level::warn,
                                                         spdlog::level::err};
  Logger()->log(kLevel[static_cast<int>(level)], "{}",
                FormatLogEvent(g_json.load(), level, context, message));
}

}  // namespace pipemare
