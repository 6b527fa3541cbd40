// The stage's checkpoint writer: the stage executor hands it each cut's
// snapshot (host memory), and its thread writes it (pipeline/core/checkpoint.h)
// while the stage trains on, then keeps the newest cuts in memory so a
// recovery that rolls back to one of them restores this stage without
// reading disk. It reports what it wrote in the stage's status.
#ifndef PIPEMARE_STAGE_WORKER_CUT_WRITER_H_
#define PIPEMARE_STAGE_WORKER_CUT_WRITER_H_

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "pipeline/model/checkpoint_units.h"
#include "pipeline/runtime/stage_runtime.h"
#include "pipemare/v1/pipemare.pb.h"
#include "stage_worker/stage_metrics.h"

namespace pipemare {

// A cut this stage wrote, kept in host memory with the files it became.
struct RetainedCut {
  std::shared_ptr<const StageSnapshot> snapshot;
  std::vector<WrittenFile> files;  // files[i] holds snapshot->units[i]
};
// The unit state in `memory` that was written to exactly `file` (path and
// SHA-256), or null.
const UnitState* FindRetainedUnit(const std::vector<RetainedCut>* memory,
                                  const v1::CheckpointFile& file);

// Where a unit of a cut came from when a stage restored it.
struct CutSources {
  int own_memory = 0;  // this worker wrote that very file and held it
  int replica = 0;     // the same stage of another replica held it (FetchUnit)
  int disk = 0;
};
// A unit of a cut from another replica's memory, checked against the file's
// SHA-256; NOT_FOUND (or any error) when none holds it.
using FetchUnit = std::function<absl::StatusOr<UnitState>(const v1::CheckpointFile&)>;

// The units of `a.restore()` that are this stage's (by unit index), each
// from `memory` when this worker itself wrote that very file (same path,
// same SHA-256), else from `fetch` (when set) if another replica holds it,
// else read from disk and checked. `sources` counts each.
absl::StatusOr<std::vector<UnitState>> LoadCutUnits(const v1::StageAssignment& a,
                                                    const std::vector<RetainedCut>* memory,
                                                    const FetchUnit& fetch, CutSources* sources);

class CutWriter {
 public:
  // Writes the cuts of stage `stage` of `job_id` under `dir` (empty: every
  // cut fails, saying the coordinator sent no checkpoint_dir); timings and
  // bytes go to `metrics`. Its thread starts at once.
  CutWriter(std::string dir, std::string job_id, int stage, std::shared_ptr<StageMetrics> metrics);
  // Finish().
  ~CutWriter();
  CutWriter(const CutWriter&) = delete;
  CutWriter& operator=(const CutWriter&) = delete;

  // Queues a cut to write. Each queued cut is a copy of the stage's state in
  // host memory: when the writer falls behind (a slow shared volume), this
  // waits for it rather than piling up copies, until Abandon.
  void Queue(std::shared_ptr<const StageSnapshot> snapshot);
  // The stage stops: Queue waits no more.
  void Abandon();
  // Writes the cuts already queued, then ends the thread. Idempotent.
  void Finish();

  // The coordinator committed the cut at `step`: older cuts leave memory.
  void NoteCommitted(int64_t step);
  // Holds `cut`, committed, the stage restored: the same stage of another
  // replica may ask for it (FetchCutUnit) and a rollback to it reads no disk.
  void Hold(RetainedCut cut);
  // The cuts kept in memory: the newest at or before the committed step and
  // at most kNewerCuts after it.
  std::vector<RetainedCut> Retained() const;
  // The newest cut written (or why the last write failed), and the cuts held.
  void Report(v1::StageStatusResponse* status) const;

 private:
  void Loop();
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Cuts written but not yet committed that stay in memory beside the
  // committed one: commits lag the stages (the coordinator polls every
  // 250 ms and verifies each cut's files), so a stage can be cuts ahead of
  // the newest commit when cuts are frequent.
  static constexpr size_t kNewerCuts = 3;
  // Cuts taken but not yet being written, at most.
  static constexpr size_t kMaxQueuedCuts = 2;

  const std::string dir_, job_id_;
  const int stage_;
  const std::shared_ptr<StageMetrics> metrics_;
  mutable absl::Mutex mu_;
  std::deque<std::shared_ptr<const StageSnapshot>> queue_ ABSL_GUARDED_BY(mu_);
  v1::CheckpointWritten written_ ABSL_GUARDED_BY(mu_);
  std::deque<RetainedCut> retained_ ABSL_GUARDED_BY(mu_);  // oldest first
  int64_t committed_step_ ABSL_GUARDED_BY(mu_) = 0;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_CUT_WRITER_H_
