#include "stage_worker/cut_writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/thread_name.h"
#include "pipeline/model/checkpoint_units.h"

namespace pipemare {
namespace {

// What a stage reports of the files a cut became.
void AddFiles(const std::vector<WrittenFile>& files, v1::CheckpointWritten* out) {
  for (const WrittenFile& f : files) {
    v1::CheckpointFile* file = out->add_files();
    file->set_unit(f.unit);
    file->set_path(f.path);
    file->set_bytes(f.bytes);
    file->set_sha256(f.sha256);
  }
}

}  // namespace

const UnitState* FindRetainedUnit(const std::vector<RetainedCut>* memory,
                                  const v1::CheckpointFile& file) {
  if (memory == nullptr) return nullptr;
  for (const RetainedCut& cut : *memory) {
    for (size_t i = 0; i < cut.files.size() && i < cut.snapshot->units.size(); ++i) {
      const WrittenFile& w = cut.files[i];
      if (w.unit == file.unit() && w.path == file.path() && w.sha256 == file.sha256() &&
          cut.snapshot->units[i].unit == file.unit()) {
        return &cut.snapshot->units[i];
      }
    }
  }
  return nullptr;
}

absl::StatusOr<std::vector<UnitState>> LoadCutUnits(const v1::StageAssignment& a,
                                                    const std::vector<RetainedCut>* memory,
                                                    const FetchUnit& fetch, CutSources* sources) {
  std::vector<UnitState> units;
  *sources = CutSources();
  for (const auto& f : a.restore()) {
    if (f.unit() < a.first_unit() || f.unit() >= a.first_unit() + a.units()) continue;
    if (const UnitState* held = FindRetainedUnit(memory, f)) {
      units.push_back(*held);
      ++sources->own_memory;
      continue;
    }
    if (fetch) {
      auto fetched = fetch(f);
      if (fetched.ok()) {
        units.push_back(std::move(*fetched));
        ++sources->replica;
        continue;
      }
      LogWarning(ForStage(a.job_id(), a.stage()),
                 absl::StrCat("unit ", f.unit(), " of the cut at step ", a.start_step(),
                              " from a replica's memory: ", fetched.status().message(),
                              "; reading ", f.path()));
    }
    auto unit = ReadUnitFile(f.path(), f.sha256());
    if (!unit.ok()) return unit.status();
    units.push_back(std::move(*unit));
    ++sources->disk;
  }
  return units;
}

CutWriter::CutWriter(std::string dir, std::string job_id, int stage,
                     std::shared_ptr<StageMetrics> metrics)
    : dir_(std::move(dir)),
      job_id_(std::move(job_id)),
      stage_(stage),
      metrics_(std::move(metrics)) {
  thread_ = std::thread([this] { Loop(); });
}

CutWriter::~CutWriter() { Finish(); }

void CutWriter::Queue(std::shared_ptr<const StageSnapshot> snapshot) {
  metrics_->checkpoint_snapshot_seconds->Observe(snapshot->seconds);
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](CutWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
        return w->queue_.size() < kMaxQueuedCuts || w->abandoned_ || w->finish_;
      },
      this));
  queue_.push_back(std::move(snapshot));
}

void CutWriter::Abandon() {
  absl::MutexLock lock(&mu_);
  abandoned_ = true;
}

void CutWriter::Finish() {
  {
    absl::MutexLock lock(&mu_);
    finish_ = true;  // cuts already queued are still written
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void CutWriter::NoteCommitted(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (step <= committed_step_) return;
  committed_step_ = step;
  PruneLocked();
}

void CutWriter::PruneLocked() {
  // A recovery rolls back to the committed cut, or to one committed after
  // this stage was asked: keep the newest cut at or before committed_step_
  // and the newest kNewerCuts after it.
  if (retained_.empty()) return;
  while (retained_.size() > 1 && retained_[1].snapshot->step <= committed_step_) {
    retained_.pop_front();
  }
  const size_t base = retained_.front().snapshot->step <= committed_step_ ? 1 : 0;
  while (retained_.size() > base + kNewerCuts) {
    retained_.erase(retained_.begin() + static_cast<std::ptrdiff_t>(base));
  }
}

void CutWriter::Hold(RetainedCut cut) {
  absl::MutexLock lock(&mu_);
  committed_step_ = std::max(committed_step_, cut.snapshot->step);
  retained_.push_back(std::move(cut));
  PruneLocked();
}

std::vector<RetainedCut> CutWriter::Retained() const {
  absl::MutexLock lock(&mu_);
  return {retained_.begin(), retained_.end()};
}

void CutWriter::Report(v1::StageStatusResponse* status) const {
  absl::MutexLock lock(&mu_);
  *status->mutable_checkpoint() = written_;
  for (const RetainedCut& cut : retained_) {
    v1::CheckpointWritten* held = status->add_held();
    held->set_step(cut.snapshot->step);
    held->set_generation(cut.snapshot->generation);
    AddFiles(cut.files, held);
  }
}

void CutWriter::Loop() {
  NameThisThread("stage-ckpt");
  // Writing a cut is background work: on a host whose cores are all busy
  // training it runs on what the compute threads leave (Linux nice is per
  // thread). Failing to lower it is harmless.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  for (;;) {
    std::shared_ptr<const StageSnapshot> snapshot;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CutWriter* w)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->finish_ || !w->queue_.empty(); },
          this));
      if (queue_.empty()) return;
      snapshot = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto start = std::chrono::steady_clock::now();
    auto files = dir_.empty() ? absl::FailedPreconditionError(
                                    "checkpoint_dir: the coordinator sent none; nothing is saved")
                              : WriteStageSnapshot(dir_, job_id_, *snapshot);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    absl::MutexLock lock(&mu_);
    if (!files.ok()) {
      written_.set_error(
          absl::StrCat("checkpoint at step ", snapshot->step, ": ", files.status().message()));
      LogError(ForStage(job_id_, stage_), written_.error());
      continue;
    }
    written_.set_step(snapshot->step);
    written_.set_generation(snapshot->generation);
    written_.clear_files();
    retained_.push_back(RetainedCut{snapshot, *files});
    PruneLocked();
    AddFiles(*files, &written_);
    int64_t bytes = 0;
    for (const WrittenFile& f : *files) bytes += f.bytes;
    metrics_->checkpoint_write_seconds->Observe(seconds);
    metrics_->checkpoint_bytes->Increment(static_cast<double>(bytes));
    LogInfo(ForStage(job_id_, stage_),
            absl::StrCat("checkpoint at step ", snapshot->step, ": ", files->size(), " units, ",
                         bytes, " bytes in ", seconds, " s"));
  }
}

}  // namespace pipemare
