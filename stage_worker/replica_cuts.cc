#include "stage_worker/replica_cuts.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "pipeline/model/checkpoint_units.h"

namespace pipemare {
namespace {

constexpr size_t kChunkBytes = 1 << 20;
// One unit from one donor: the donor is loaded and idle (replica 0 loads
// first), so this is the transfer's time, not a wait for training.
constexpr int kFetchDeadlineSeconds = 30;

absl::StatusOr<UnitState> FetchFrom(v1::StageWorker::Stub& stub, const std::string& donor,
                                    const std::string& job_id, const v1::CheckpointFile& file) {
  v1::FetchCutUnitRequest request;
  request.set_job_id(job_id);
  *request.mutable_file() = file;
  auto ctx = ContextWithDeadline(kFetchDeadlineSeconds);
  auto reader = stub.FetchCutUnit(ctx.get(), request);
  std::string bytes;
  v1::CutUnitChunk chunk;
  while (reader->Read(&chunk)) {
    if (static_cast<int64_t>(bytes.size() + chunk.data().size()) > file.bytes()) {
      ctx->TryCancel();
      reader->Finish().IgnoreError();
      return absl::DataLossError(
          absl::StrCat(donor, " sent more than the file's ", file.bytes(), " bytes"));
    }
    bytes += chunk.data();
  }
  if (grpc::Status st = reader->Finish(); !st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                        absl::StrCat(donor, ": ", st.error_message()));
  }
  return ParseUnitFile(bytes, file.sha256(), absl::StrCat("unit ", file.unit(), " from ", donor));
}

}  // namespace

FetchUnit FetchFromReplicas(const v1::StageAssignment& a) {
  if (a.replica_donors().empty() || a.restore_weights_only()) return nullptr;
  // One channel per donor for all the units.
  std::vector<std::pair<std::string, std::shared_ptr<v1::StageWorker::Stub>>> donors;
  for (const std::string& donor : a.replica_donors()) {
    donors.emplace_back(donor, v1::StageWorker::NewStub(MakeChannel(donor)));
  }
  return
      [donors, job_id = a.job_id()](const v1::CheckpointFile& file) -> absl::StatusOr<UnitState> {
        std::string why;
        for (const auto& [donor, stub] : donors) {
          auto unit = FetchFrom(*stub, donor, job_id, file);
          if (unit.ok()) return unit;
          absl::StrAppend(&why, why.empty() ? "" : "; ", unit.status().message());
        }
        return absl::NotFoundError(why);
      };
}

grpc::Status ServeCutUnit(const std::string& job_id, const std::vector<RetainedCut>& memory,
                          const v1::FetchCutUnitRequest& request,
                          grpc::ServerWriter<v1::CutUnitChunk>* writer) {
  if (request.job_id().empty() || request.job_id() != job_id) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("holds no cut of job ", request.job_id()));
  }
  const v1::CheckpointFile& f = request.file();
  for (const RetainedCut& cut : memory) {
    for (size_t i = 0; i < cut.files.size() && i < cut.snapshot->units.size(); ++i) {
      const WrittenFile& w = cut.files[i];
      if (w.unit != f.unit() || w.path != f.path() || w.sha256 != f.sha256()) continue;
      auto bytes = UnitFileBytes(cut.snapshot->units[i], cut.snapshot->step);
      if (!bytes.ok()) return ToGrpc(bytes.status());
      v1::CutUnitChunk chunk;
      for (size_t at = 0; at < bytes->size(); at += kChunkBytes) {
        chunk.set_data(bytes->substr(at, std::min(kChunkBytes, bytes->size() - at)));
        if (!writer->Write(chunk)) {
          return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
        }
      }
      return grpc::Status::OK;
    }
  }
  return grpc::Status(grpc::StatusCode::NOT_FOUND,
                      absl::StrCat("holds no unit ", f.unit(), " of ", f.path(), " in memory"));
}

}  // namespace pipemare
