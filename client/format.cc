#include "client/format.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/core/schedule.h"
#include "pipeline/core/settings.h"

namespace pipemare::client {
namespace {

constexpr int kBarWidth = 20;
constexpr size_t kReasonWidth = 40;

double MonotonicSeconds() {
  using Clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

int64_t NowUnixMs() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

std::string OrDash(const std::string& text) { return text.empty() ? "-" : text; }

std::string Percent(double fraction) { return Format("%.1f%%", fraction * 100.0); }

bool IsLanguageModel(const v1::JobStatus& job) {
  return ParseTask(job.task()).value_or(Task::kClassification) == Task::kLanguageModel;
}

// What test accuracy counts: next tokens for language models.
const char* AccuracyLabel(const v1::JobStatus& job) {
  return IsLanguageModel(job) ? "token accuracy" : "test accuracy";
}

// Language models' perplexity, once reported (0: not shown).
double Perplexity(const v1::JobStatus& job, double perplexity) {
  return IsLanguageModel(job) && perplexity > 0 ? perplexity : 0;
}

// Test accuracy is meaningful only once an epoch has finished.
std::string AccuracyCell(const v1::JobStatus& job) {
  return job.epochs_size() > 0 ? Percent(job.metrics().test_accuracy()) : "-";
}

// Train loss is meaningful only once a step has been done.
std::string LossCell(const v1::JobStatus& job) {
  return job.progress().step() > 0 ? Format("%.4f", job.metrics().train_loss()) : "-";
}

std::string EpochCell(const v1::JobStatus& job) {
  return Format("%d/%d", job.progress().epoch(), job.progress().epochs());
}

std::string StepCell(const v1::JobStatus& job) {
  return Format("%lld/%lld", static_cast<long long>(job.progress().step()),
                static_cast<long long>(job.progress().total_steps()));
}

std::string UnitsCell(const v1::StageStatus& stage) {
  if (stage.units() <= 0) return "-";
  if (stage.units() == 1) return Format("%d", stage.first_unit());
  return Format("%d..%d", stage.first_unit(), stage.first_unit() + stage.units() - 1);
}

// Seconds the job has run: the coordinator's figure, or from the timestamps.
double ElapsedSeconds(const v1::JobStatus& job) {
  if (job.metrics().elapsed_seconds() > 0) return job.metrics().elapsed_seconds();
  if (job.started_unix_ms() <= 0) return 0;
  int64_t end = job.finished_unix_ms() > 0 ? job.finished_unix_ms() : NowUnixMs();
  return std::max<int64_t>(0, end - job.started_unix_ms()) / 1000.0;
}

std::string ProgressBar(const v1::JobStatus& job) {
  double fraction = 0;
  if (job.progress().total_steps() > 0) {
    fraction = static_cast<double>(job.progress().step()) /
               static_cast<double>(job.progress().total_steps());
  }
  if (job.state() == v1::SUCCEEDED) fraction = 1;
  fraction = std::clamp(fraction, 0.0, 1.0);
  int filled = static_cast<int>(std::lround(fraction * kBarWidth));
  return absl::StrCat("[", std::string(filled, '#'), std::string(kBarWidth - filled, '.'), "]");
}

std::string EpochLine(const v1::JobStatus& job, const v1::EpochResult& epoch) {
  const double perplexity = Perplexity(job, epoch.test_perplexity());
  return Format("%s epoch %d/%d done: train loss %.4f  test loss %.4f  %s %s%s  (%.1f s)",
                job.id().c_str(), epoch.epoch(), job.progress().epochs(), epoch.train_loss(),
                epoch.test_loss(), AccuracyLabel(job), Percent(epoch.test_accuracy()).c_str(),
                perplexity > 0 ? Format("  test perplexity %.2f", perplexity).c_str() : "",
                epoch.seconds());
}

// Terminal width for `out`, or 0 if it is not a terminal.
size_t TerminalWidth(FILE* out) {
  struct winsize size {};
  if (ioctl(fileno(out), TIOCGWINSZ, &size) == 0 && size.ws_col > 0) {
    return size.ws_col;
  }
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------
// TextTable

TextTable::TextTable(std::vector<std::string> header)
    : header_(std::move(header)), right_(header_.size(), false) {}

void TextTable::AlignRight(int column) {
  if (column >= 0 && column < static_cast<int>(right_.size())) {
    right_[column] = true;
  }
}

void TextTable::AddRow(std::vector<std::string> cells) {
  cells.resize(header_.size());
  rows_.push_back(std::move(cells));
}

std::string TextTable::Render() const {
  const size_t columns = header_.size();
  std::vector<size_t> width(columns, 0);
  auto measure = [&](const std::vector<std::string>& row) {
    for (size_t c = 0; c < columns; ++c) width[c] = std::max(width[c], row[c].size());
  };
  measure(header_);
  for (const auto& row : rows_) measure(row);

  std::string out;
  auto emit = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < columns; ++c) {
      if (c > 0) line += "  ";
      std::string pad(width[c] - row[c].size(), ' ');
      line += right_[c] ? pad + row[c] : row[c] + pad;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  };
  bool has_header =
      std::any_of(header_.begin(), header_.end(), [](const std::string& h) { return !h.empty(); });
  if (has_header) emit(header_);
  for (const auto& row : rows_) emit(row);
  return out;
}

// ---------------------------------------------------------------------------
// Small formatters

std::string Format(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  int size = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::string out;
  if (size > 0) {
    out.resize(static_cast<size_t>(size) + 1);
    std::vsnprintf(out.data(), out.size(), format, args);
    out.resize(static_cast<size_t>(size));
  }
  va_end(args);
  return out;
}

std::string FormatDuration(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return "-";
  auto total = static_cast<long long>(std::llround(seconds));
  long long hours = total / 3600, minutes = (total / 60) % 60, secs = total % 60;
  if (hours > 0) return Format("%lld:%02lld:%02lld", hours, minutes, secs);
  return Format("%lld:%02lld", minutes, secs);
}

std::string FormatBytes(int64_t bytes) {
  if (bytes < 1024) return Format("%lld B", static_cast<long long>(bytes));
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (value >= 1024 && u < 3) {
    value /= 1024;
    ++u;
  }
  return Format(value < 10 ? "%.2f %s" : "%.1f %s", value, units[u]);
}

std::string Truncate(const std::string& text, size_t width) {
  if (text.size() <= width) return text;
  if (width <= 3) return text.substr(0, width);
  return text.substr(0, width - 3) + "...";
}

std::string StateName(v1::JobState state) { return v1::JobState_Name(state); }

std::string WorkerStateName(v1::WorkerState state) { return v1::WorkerState_Name(state); }

bool IsTerminal(v1::JobState state) {
  return state == v1::SUCCEEDED || state == v1::FAILED || state == v1::CANCELLED;
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::StrCat("{\"error\": \"cannot render JSON: ", std::string(status.message()),
                        "\"}\n");
  }
  if (json.empty() || json.back() != '\n') json += '\n';
  return json;
}

// ---------------------------------------------------------------------------
// Views

std::string RenderEpochTable(const v1::JobStatus& job) {
  if (job.epochs_size() == 0) return "";
  // Language models: token accuracy, and perplexity once any epoch has one.
  bool perplexity = false;
  for (const auto& epoch : job.epochs()) {
    perplexity = perplexity || Perplexity(job, epoch.test_perplexity()) > 0;
  }
  std::vector<std::string> header = {"EPOCH", "TRAIN-LOSS", "TEST-LOSS",
                                     IsLanguageModel(job) ? "TOKEN-ACC" : "TEST-ACC"};
  if (perplexity) header.push_back("TEST-PPL");
  header.push_back("SECONDS");
  const int columns = static_cast<int>(header.size());
  TextTable table(std::move(header));
  for (int c = 0; c < columns; ++c) table.AlignRight(c);
  for (const auto& epoch : job.epochs()) {
    std::vector<std::string> row = {Format("%d", epoch.epoch()), Format("%.4f", epoch.train_loss()),
                                    Format("%.4f", epoch.test_loss()),
                                    Percent(epoch.test_accuracy())};
    if (perplexity) {
      const double ppl = Perplexity(job, epoch.test_perplexity());
      row.push_back(ppl > 0 ? Format("%.2f", ppl) : "-");
    }
    row.push_back(Format("%.1f", epoch.seconds()));
    table.AddRow(std::move(row));
  }
  return table.Render();
}

std::string RenderJobStatus(const v1::JobStatus& job) {
  const auto& progress = job.progress();
  const auto& metrics = job.metrics();

  TextTable summary({"", ""});
  summary.AddRow({"ID", job.id()});
  summary.AddRow({"NAME", job.name()});
  summary.AddRow({"STATE", StateName(job.state())});
  summary.AddRow({"REASON", OrDash(job.reason())});
  std::string schedule = OrDash(job.schedule());
  const auto& spec_schedule = job.spec().schedule();
  if (IsAsynchronous(ScheduleKindOf(spec_schedule)) &&
      (spec_schedule.warmup_steps() > 0 || spec_schedule.warmup_epochs() > 0)) {
    const int64_t switched = job.stages_size() ? job.stages(0).async_from_step() : -1;
    schedule += switched >= 0 ? Format(" (synchronous warm-up, asynchronous from step %lld)",
                                       static_cast<long long>(switched))
                              : " (synchronous warm-up)";
  }
  // How the backward gets the forward's activations (schedule.recompute).
  if (!spec_schedule.type().empty()) {
    schedule += Recomputes(spec_schedule) ? "; backward recomputes the forward"
                                          : "; backward uses the forward's graph";
  }
  summary.AddRow({"SCHEDULE", schedule});
  if (const int replicas = Replicas(spec_schedule); replicas > 1) {
    // What every stage's all-reduce with its replicas cost (replica 0's).
    int64_t allreduces = 0, bytes = 0;
    double seconds = 0;
    for (const auto& stage : job.stages()) {
      allreduces += stage.allreduces();
      bytes += stage.allreduce_bytes();
      seconds += stage.allreduce_seconds();
    }
    summary.AddRow(
        {"REPLICAS",
         Format("%d pipelines of %d stages (%d workers); effective batch %lld = %d x %d x %d; "
                "gradient all-reduces: %lld, %.2f s, %s",
                replicas, spec_schedule.stages(), replicas * spec_schedule.stages(),
                static_cast<long long>(replicas) * spec_schedule.microbatches_per_step() *
                    spec_schedule.microbatch_size(),
                replicas, spec_schedule.microbatches_per_step(), spec_schedule.microbatch_size(),
                static_cast<long long>(allreduces), seconds, FormatBytes(bytes).c_str())});
  }
  if (!job.partition().empty()) {
    std::string partition = job.partition();
    const auto& split = spec_schedule.split();
    if (PartitionOf(job.partition()) == PartitionKind::kSplit && !split.empty()) {
      partition += " (stages start at units 0";
      for (int first : split) absl::StrAppend(&partition, ", ", first);
      partition += ")";
    }
    summary.AddRow({"PARTITION", partition});
  }
  std::string progress_text = Format("epoch %d/%d, step %lld/%lld", progress.epoch(),
                                     progress.epochs(), static_cast<long long>(progress.step()),
                                     static_cast<long long>(progress.total_steps()));
  if (progress.total_steps() > 0) {
    progress_text += Format(" (%.0f%%)", 100.0 * progress.step() / progress.total_steps());
  }
  summary.AddRow({"PROGRESS", progress_text});
  const double perplexity = job.epochs_size() > 0 ? Perplexity(job, metrics.test_perplexity()) : 0;
  summary.AddRow(
      {"METRICS", Format("train loss %s, %s %s%s, %.0f samples/s", LossCell(job).c_str(),
                         AccuracyLabel(job), AccuracyCell(job).c_str(),
                         perplexity > 0 ? Format(", test perplexity %.2f", perplexity).c_str() : "",
                         metrics.samples_per_second())});
  std::string elapsed = FormatDuration(ElapsedSeconds(job));
  if (job.state() == v1::RUNNING && metrics.eta_seconds() > 0) {
    elapsed += absl::StrCat(" (ETA ", FormatDuration(metrics.eta_seconds()), ")");
  }
  summary.AddRow({"ELAPSED", elapsed});
  if (job.checkpoint().step() > 0) {
    summary.AddRow({"CHECKPOINT", Format("step %lld (%d committed)",
                                         static_cast<long long>(job.checkpoint().step()),
                                         job.checkpoint().committed())});
  }
  for (int i = 0; i < job.restarts_size(); ++i) {
    const auto& r = job.restarts(i);
    // Where the restored state came from, when not (only) the files.
    std::string restored;
    if (r.restored_from_memory() > 0) {
      restored += Format(", %d restored from their own memory", r.restored_from_memory());
    }
    if (r.restored_from_replica() > 0) {
      restored += Format(", %d restored from replica 0's memory", r.restored_from_replica());
    }
    summary.AddRow(
        {i == 0 ? "RESTARTS" : "",
         Format("%d: stage %d (%s) lost at step %lld, on from step %lld on %d stages%s%s; %s",
                i + 1, r.stage(), OrDash(r.worker_id()).c_str(),
                static_cast<long long>(r.failed_at_step()), static_cast<long long>(r.from_step()),
                r.stages(),
                r.recover_seconds() > 0
                    ? Format(", trained again after %.1f s", r.recover_seconds()).c_str()
                    : "",
                restored.c_str(), r.cause().c_str())});
  }

  std::string out = summary.Render();

  if (job.stages_size() > 0) {
    // Memory at its peak: weights + optimizer state + T2 velocity + stash
    // (the paper's measure), and the saved stage inputs. PREDICTED: the
    // partitioner's forward + backward time of one microbatch ("profile");
    // the last column marks the stage the partition predicts slowest.
    bool predicted = false;
    for (const auto& stage : job.stages()) predicted = predicted || stage.predicted_seconds() > 0;
    std::vector<std::string> header = {"STAGE", "WORKER", "ADDRESS", "UNITS", "PARAMS"};
    if (predicted) header.push_back("PREDICTED");
    for (const char* h : {"TAU", "MEASURED-TAU", "LR", "WEIGHTS+OPT", "ACTIVATIONS", ""}) {
      header.push_back(h);
    }
    const int columns = static_cast<int>(header.size());
    TextTable stages(std::move(header));
    stages.AlignRight(0);
    for (int c = 4; c < columns - 1; ++c) stages.AlignRight(c);  // PARAMS .. ACTIVATIONS
    int64_t total = 0;
    for (const auto& stage : job.stages()) {
      const auto& peak = stage.peak_memory();
      const int64_t weights_and_optimizer =
          peak.weights() + peak.optimizer_state() + peak.t2_velocity() + peak.stash();
      total += weights_and_optimizer;
      std::vector<std::string> row = {Format("%d", stage.index()), OrDash(stage.worker_id()),
                                      OrDash(stage.worker_address()), UnitsCell(stage),
                                      Format("%lld", static_cast<long long>(stage.parameters()))};
      if (predicted) {
        row.push_back(stage.predicted_seconds() > 0
                          ? Format("%.2f ms", stage.predicted_seconds() * 1000.0)
                          : "-");
      }
      for (std::string cell :
           {Format("%d", stage.analytic_delay()), Format("%.2f", stage.measured_delay()),
            Format("%.6g", stage.learning_rate()), FormatBytes(weights_and_optimizer),
            FormatBytes(peak.saved_activations()),
            std::string(stage.bottleneck() ? "<- bottleneck" : "")}) {
        row.push_back(std::move(cell));
      }
      stages.AddRow(std::move(row));
    }
    out += "\n" + stages.Render();
    out += Format("peak weights + optimizer state + stash, all stages: %s\n",
                  FormatBytes(total).c_str());
    std::vector<std::string> skipped;
    for (const auto& stage : job.stages()) {
      if (stage.nonfinite_skipped() > 0) {
        skipped.push_back(Format("stage %d: %lld", stage.index(),
                                 static_cast<long long>(stage.nonfinite_skipped())));
      }
    }
    if (!skipped.empty()) {
      out += "microbatches skipped for a NaN or Inf (train.on_nonfinite: skip): " +
             absl::StrJoin(skipped, ", ") + "\n";
    }
  }

  std::string epochs = RenderEpochTable(job);
  if (!epochs.empty()) out += "\n" + epochs;
  return out;
}

std::string RenderJobList(const v1::ListJobsResponse& jobs) {
  TextTable table({"ID", "NAME", "STATE", "SCHEDULE", "EPOCH", "STEP", "LOSS", "ACC", "REASON"});
  for (int c : {4, 5, 6, 7}) table.AlignRight(c);
  for (const auto& job : jobs.jobs()) {
    table.AddRow({job.id(), job.name(), StateName(job.state()), OrDash(job.schedule()),
                  EpochCell(job), StepCell(job), LossCell(job), AccuracyCell(job),
                  Truncate(job.reason(), kReasonWidth)});
  }
  return table.Render();
}

std::string RenderWorkers(const v1::ListWorkersResponse& workers, int64_t now_unix_ms) {
  TextTable table({"ID", "ADDRESS", "DEVICE", "THREADS", "STATE", "JOB", "STAGE", "HOLDS",
                   "LAST-HEARTBEAT", "METRICS"});
  for (int c : {3, 6, 7}) table.AlignRight(c);
  for (const auto& worker : workers.workers()) {
    bool assigned = !worker.job_id().empty();
    std::string age = "-";
    if (worker.last_heartbeat_unix_ms() > 0) {
      double seconds = std::max<int64_t>(0, now_unix_ms - worker.last_heartbeat_unix_ms()) / 1000.0;
      age = Format("%.1fs ago", seconds);
    }
    table.AddRow({worker.id(), worker.address(), OrDash(worker.device()),
                  Format("%d", worker.threads()), WorkerStateName(worker.state()),
                  assigned ? worker.job_id() : "-", assigned ? Format("%d", worker.stage()) : "-",
                  // The stage whose cuts it keeps in memory (ServedStage).
                  worker.served().job_id().empty()
                      ? "-"
                      : absl::StrCat(worker.served().job_id(), " stage ", worker.served().stage()),
                  age, OrDash(worker.metrics_address())});
  }
  return table.Render();
}

std::string RenderSubmitted(const v1::JobStatus& job) {
  return Format("submitted %s (%s), state %s", job.id().c_str(), job.name().c_str(),
                StateName(job.state()).c_str());
}

std::string RenderFinalState(const v1::JobStatus& job) {
  std::string line = absl::StrCat(job.id(), " ", StateName(job.state()));
  if (!job.reason().empty()) absl::StrAppend(&line, ": ", job.reason());
  return line;
}

std::string RenderProgressLine(const v1::JobStatus& job, bool with_bar) {
  std::string line = absl::StrCat(job.id(), " ", StateName(job.state()));
  if (job.state() == v1::PENDING || job.state() == v1::JOB_STATE_UNSPECIFIED) {
    if (!job.reason().empty()) absl::StrAppend(&line, " (", job.reason(), ")");
    return line;
  }
  absl::StrAppend(&line, " epoch ", EpochCell(job));
  if (with_bar) absl::StrAppend(&line, " ", ProgressBar(job));
  absl::StrAppend(&line, " step ", StepCell(job), "  loss ", LossCell(job),
                  IsLanguageModel(job) ? "  token acc " : "  acc ", AccuracyCell(job));
  const double perplexity =
      job.epochs_size() > 0 ? Perplexity(job, job.metrics().test_perplexity()) : 0;
  if (perplexity > 0) absl::StrAppend(&line, "  ppl ", Format("%.2f", perplexity));
  absl::StrAppend(&line, "  ", Format("%.0f", job.metrics().samples_per_second()), " samples/s");
  if (job.state() == v1::RUNNING) {
    absl::StrAppend(
        &line, "  ETA ",
        job.metrics().eta_seconds() > 0 ? FormatDuration(job.metrics().eta_seconds()) : "-");
  }
  return line;
}

// ---------------------------------------------------------------------------
// ProgressPrinter

ProgressPrinter::ProgressPrinter(FILE* out, bool live, double plain_interval_seconds)
    : out_(out), live_(live), plain_interval_seconds_(plain_interval_seconds) {}

ProgressPrinter::~ProgressPrinter() { Finish(); }

void ProgressPrinter::Update(const v1::JobStatus& job) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool first = !have_job_;
  const v1::JobStatus previous = std::move(last_);
  last_ = job;
  have_job_ = true;

  if (live_) {
    DrawLocked();
    return;
  }

  const double now = MonotonicSeconds();
  bool printed = false;
  // A line when the state changes (the final state is the caller's to print).
  if ((first || previous.state() != job.state()) && !IsTerminal(job.state())) {
    std::fprintf(out_, "%s\n", RenderProgressLine(job, false).c_str());
    printed = true;
  }
  // A line per newly finished epoch (a job that already ended gets its epoch
  // table from the caller instead).
  // table from the caller instead). Each epoch once: a resume from a cut
  // inside an epoch takes its result back and reports it again at its end.
  for (const auto& epoch : job.epochs()) {
    if (epoch.epoch() <= last_epoch_printed_) continue;
    last_epoch_printed_ = epoch.epoch();
    if (first && IsTerminal(job.state())) continue;
    std::fprintf(out_, "%s\n", EpochLine(job, epoch).c_str());
    printed = true;
  }
  // Otherwise a progress line now and then.
  if (!printed && job.state() == v1::RUNNING && now - last_plain_line_ >= plain_interval_seconds_) {
    std::fprintf(out_, "%s\n", RenderProgressLine(job, false).c_str());
    printed = true;
  }
  if (printed) {
    last_plain_line_ = now;
    std::fflush(out_);
  }
}

void ProgressPrinter::Note(const std::string& line) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool redraw = live_ && drawn_width_ > 0;
  if (redraw) ClearLocked();
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  if (redraw) DrawLocked();
}

void ProgressPrinter::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (live_ && drawn_width_ > 0) {
    std::fputc('\n', out_);
    std::fflush(out_);
    drawn_width_ = 0;
  }
}

void ProgressPrinter::DrawLocked() {
  if (!have_job_) return;
  std::string line = RenderProgressLine(last_, /*with_bar=*/true);
  // Never wrap: a wrapped line cannot be redrawn with '\r'.
  size_t columns = TerminalWidth(out_);
  if (columns > 1) line = Truncate(line, columns - 1);
  size_t width = line.size();
  if (width < drawn_width_) line.append(drawn_width_ - width, ' ');
  std::fprintf(out_, "\r%s", line.c_str());
  std::fflush(out_);
  drawn_width_ = width;
}

void ProgressPrinter::ClearLocked() {
  std::fprintf(out_, "\r%s\r", std::string(drawn_width_, ' ').c_str());
  std::fflush(out_);
  drawn_width_ = 0;
}

}  // namespace pipemare::client
