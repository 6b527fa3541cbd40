// Checkpoints (no LibTorch here; unit files: pipeline/model/checkpoint_units.h):
// a stage's state at a cut, kept per unit (layer) so that it
// loads into any partition, and the files and manifest that hold it.
//
// The cut at step k: every stage snapshots right after applying its k-th
// optimizer step, the one holding microbatch k·N's gradient (the stage
// executor does it, pipeline/runtime/stage_executor.h). Microbatches after k·N are
// replayed on resume, so no stash or in-flight activation is saved.
//
// Layout under checkpoint.dir:
//   <job>/step-<k>/unit-<u>[.g<n>].pt  one unit's state: a torch::pickle_save'd
//                                 Dict[str, Tensor] (keys below), written by
//                                 a stage of generation n
//   <job>/step-<k>/manifest.json  job, step k, microbatch k·N, epoch and
//                                 index in the epoch, partition, the spec,
//                                 and per file its bytes and SHA-256;
//                                 committed last, by the coordinator
//   <job>/latest                  "step-<k>", moved only after the manifest
// Every file is written to a temporary name, fsynced and renamed.
//
// Keys of a unit file (names are the unit's own, e.g. "seq.1.weight"):
//   param/<name>  buffer/<name>  t2/<name> (T2's δ)
//   optim/<name>/<field> (momentum_buffer; step, exp_avg, exp_avg_sq,
//   max_exp_avg_sq)  meta/step (the cut's k)  meta/unit
#ifndef PIPEMARE_PIPELINE_CHECKPOINT_H_
#define PIPEMARE_PIPELINE_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pipemare {

struct WrittenFile {
  int unit = 0;
  std::string path;
  int64_t bytes = 0;
  std::string sha256;  // lowercase hex
};

// Lowercase hex SHA-256 of `bytes`.
std::string Sha256Hex(const std::string& bytes);

// SHA-256 of bytes given in pieces (a file read block by block).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(const void* data, size_t size);
  std::string Hex();  // lowercase; once, after the last Update
 private:
  void* ctx_;  // EVP_MD_CTX
};

// Writes `bytes` to `path` atomically: a temporary name in the same
// directory, fsync, rename, fsync of the directory. Creates the directory.
absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes);

// Reads a whole file; NOT_FOUND or DATA_LOSS naming the path.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// The last component of `path` (a manifest names its files relative to
// their step directory).
std::string BaseName(const std::string& path);

// "<dir>/<job>/step-<k>"
std::string CheckpointStepDir(const std::string& dir, const std::string& job, int64_t step);

// What the coordinator commits once every stage has written the cut.
struct Manifest {
  std::string job;
  int64_t generation = 0;  // the run that took the cut (fencing)
  int64_t step = 0;        // the cut: after this optimizer step
  int64_t microbatch = 0;  // step · N: the last microbatch whose gradient is in
  // Data position of the next microbatch: epoch (1-based) and its index in
  // that epoch's order.
  int64_t epoch = 1;
  int64_t index_in_epoch = 0;
  int64_t seed = 0;
  struct Stage {
    int first_unit = 0;
    int units = 0;
  };
  std::vector<Stage> stages;  // the partition the cut was taken with
  std::string spec_json;      // the job's resolved spec (protobuf JSON)
  std::string input_json;     // {"shape": [...], "tokens": bool, "normalisation": [{mean, std}]}
  std::vector<WrittenFile> files;  // one per unit; paths relative to the step's directory
};

// Checks that `m.files` are the model's units 0..U-1 each once, reads every
// file and checks its size and SHA-256, then writes
// CheckpointStepDir(dir, m.job, m.step)/manifest.json and, only then, moves
// <dir>/<job>/latest to it. Deletes checkpoints older than the newest `keep`.
// FAILED_PRECONDITION / DATA_LOSS naming the file that does not match.
// Fencing: FAILED_PRECONDITION when "latest" already names a cut of a newer
// generation (a stale coordinator or run never moves it back).
absl::Status CommitManifest(const std::string& dir, const Manifest& m, int keep);

// Reads and fully verifies the manifest of `step_dir` (every file present,
// of its size and SHA-256). DATA_LOSS or NOT_FOUND naming what is wrong.
absl::StatusOr<Manifest> ReadManifest(const std::string& step_dir);

// The newest checkpoint of `job` that verifies: "latest" first, then older
// step directories, newest first. `skipped` (optional) receives one line per
// damaged checkpoint passed over. NOT_FOUND when none verifies.
// The steps of `job`'s committed cuts in `dir` (those with a manifest),
// oldest first; not verified.
std::vector<int64_t> CommittedSteps(const std::string& dir, const std::string& job);

absl::StatusOr<Manifest> NewestValidManifest(const std::string& dir, const std::string& job,
                                             std::vector<std::string>* skipped = nullptr);

// The whole model of a verified checkpoint, for PyTorch users:
//   state_dict: torch::pickle_save of a Dict[str, Tensor] keyed as
//     nn.Sequential(unit_0, unit_1, ...) names it: "<unit>.<layer>.<name>"
//     (torch.load in Python; model.load_state_dict).
//   torchscript (`torchscript` holds the job's file): the same module with
//     the trained weights and buffers, saved (torch.jit.load).
struct ExportedModel {
  std::string bytes;
  std::string format;  // "state_dict" | "torchscript"
};
absl::StatusOr<ExportedModel> ExportModel(const std::string& step_dir, const Manifest& m,
                                          const std::string& torchscript);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_CHECKPOINT_H_
