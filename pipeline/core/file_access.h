// What a job's files may be: the coordinator's --data-root directories and
// the checks every data, model and checkpoint path of a spec passes before it
// is opened (docs/security.md). A job's spec comes from a remote client; its
// paths are read on the coordinator's host.
#ifndef PIPEMARE_PIPELINE_FILE_ACCESS_H_
#define PIPEMARE_PIPELINE_FILE_ACCESS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pipemare {

// The directories a job may read data and models from and keep checkpoints
// in, for this process (set once at start-up; none set: anywhere, the
// default of in-process tools and tests). Each must exist; stored resolved.
// Errors name `flag`.
// `owner` names whose roots they are in errors ("the coordinator's").
absl::Status SetDataRoots(const std::vector<std::string>& roots, const std::string& flag,
                          const std::string& owner = "this host's");
const std::vector<std::string>& DataRoots();

// OK when `path` may be opened as a job's input: it resolves (symlinks
// followed) to a regular file (not a directory, device, FIFO or socket) that
// is not under /proc, /sys or /dev, and lies under a data root when roots
// are set. INVALID_ARGUMENT naming `field`, the path and the fix otherwise.
absl::Status CheckReadableFile(const std::string& path, const std::string& field);

// OK when the directory `path` (which may not exist yet) resolves to a place
// under a data root (or `extra_root`, e.g. the coordinator's own checkpoint
// directory), or when no roots are set. Errors name `field`.
absl::Status CheckDirectoryUnderRoots(const std::string& path, const std::string& field,
                                      const std::string& extra_root = "");

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_FILE_ACCESS_H_
