// Live recovery with replicas (schedule.replicas): a stage restoring a cut
// takes each unit it does not hold itself from the memory of the same stage
// of another replica, over the StageWorker service (FetchCutUnit), instead of
// reading the checkpoint's file. The replicas hold the same weights and
// optimizer state (they all-reduce every step), so the bytes a donor sends are
// the file's very bytes and are checked against its SHA-256.
#ifndef PIPEMARE_STAGE_WORKER_REPLICA_CUTS_H_
#define PIPEMARE_STAGE_WORKER_REPLICA_CUTS_H_

#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/cut_writer.h"

namespace pipemare {

// Asks `a.replica_donors()` in order for a unit of the cut `a` restores;
// null when the assignment names no donor.
FetchUnit FetchFromReplicas(const v1::StageAssignment& a);

// Serves `request` from `memory` (the cuts a worker holds of `job_id`): the
// unit file's bytes in chunks, or NOT_FOUND.
grpc::Status ServeCutUnit(const std::string& job_id, const std::vector<RetainedCut>& memory,
                          const v1::FetchCutUnitRequest& request,
                          grpc::ServerWriter<v1::CutUnitChunk>* writer);

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_REPLICA_CUTS_H_
