// Rendering for pipemarectl: aligned text tables, job/worker views, JSON, and
// the progress display used while following a job. Nothing here talks to the
// network.
#ifndef PIPEMARE_CLIENT_FORMAT_H_
#define PIPEMARE_CLIENT_FORMAT_H_

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare::client {

// A plain-text table: a header row and data rows, columns padded to their
// widest cell and separated by two spaces. Trailing blanks are trimmed.
class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header);

  // Right-aligns column `column` (for numbers).
  void AlignRight(int column);
  // Adds a row; missing cells render empty, extra cells are dropped.
  void AddRow(std::vector<std::string> cells);
  bool empty() const { return rows_.empty(); }

  // The table, one line per row, each ending in '\n'.
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// printf into a std::string.
std::string Format(const char* format, ...) __attribute__((format(printf, 1, 2)));

// "0:42", "12:05", "1:02:03". Negative values render as "-".
std::string FormatDuration(double seconds);

// Bytes in binary units: "512 B", "1.5 KiB", "12.0 MiB", "3.25 GiB".
std::string FormatBytes(int64_t bytes);

// `text` cut to `width` characters, ending in "..." when cut.
std::string Truncate(const std::string& text, size_t width);

// "RUNNING", "IDLE"... (the enum value names).
std::string StateName(v1::JobState state);
std::string WorkerStateName(v1::WorkerState state);

// True for SUCCEEDED, FAILED and CANCELLED.
bool IsTerminal(v1::JobState state);

// The message as JSON: proto field names, primitive fields always printed,
// indented, ending in '\n'.
std::string ToJson(const google::protobuf::Message& message);

// `pipemarectl status`: summary, stage table, per-epoch results.
std::string RenderJobStatus(const v1::JobStatus& job);
// The per-epoch results table alone (empty string if no epoch finished).
std::string RenderEpochTable(const v1::JobStatus& job);
// `pipemarectl list`.
std::string RenderJobList(const v1::ListJobsResponse& jobs);
// `pipemarectl workers`; heartbeat ages are relative to `now_unix_ms`.
std::string RenderWorkers(const v1::ListWorkersResponse& workers, int64_t now_unix_ms);
// "submitted job-3 (mnist-pipemare), state PENDING".
std::string RenderSubmitted(const v1::JobStatus& job);
// "job-3 SUCCEEDED" plus ": reason" when there is one.
std::string RenderFinalState(const v1::JobStatus& job);

// One-line progress:
// "job-3 RUNNING epoch 1/2 [####....] step 512/1874  loss 0.2154  acc 96.8%
//  1520 samples/s  ETA 0:42". The bar is left out when `with_bar` is false.
std::string RenderProgressLine(const v1::JobStatus& job, bool with_bar);

// Shows the progress of a followed job on `out`. Live mode (a terminal)
// redraws a single line with '\r'; plain mode prints a line when the state
// changes, one per finished epoch, and otherwise at most one progress line
// every `plain_interval_seconds`. Thread-safe.
class ProgressPrinter {
 public:
  ProgressPrinter(FILE* out, bool live, double plain_interval_seconds = 5.0);
  ~ProgressPrinter();

  ProgressPrinter(const ProgressPrinter&) = delete;
  ProgressPrinter& operator=(const ProgressPrinter&) = delete;

  void Update(const v1::JobStatus& job);
  // Prints `line` on stderr without garbling the live line.
  void Note(const std::string& line);
  // Ends the live line (if any) so that later output starts on a fresh line.
  void Finish();

 private:
  void DrawLocked();
  void ClearLocked();

  FILE* const out_;
  const bool live_;
  const double plain_interval_seconds_;
  std::mutex mu_;
  bool have_job_ = false;
  v1::JobStatus last_;
  size_t drawn_width_ = 0;         // live: characters of the line on screen
  double last_plain_line_ = -1e9;  // monotonic seconds
  int last_epoch_printed_ = 0;     // plain: the newest epoch line printed
};

}  // namespace pipemare::client

#endif  // PIPEMARE_CLIENT_FORMAT_H_
