#include "client/local.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/follow.h"
#include "client/format.h"
#include "common/dev_pki.h"
#include "common/metrics.h"
#include "common/rpc.h"

namespace pipemare::client {
namespace {

constexpr double kCoordinatorStartSeconds = 30;
constexpr double kWorkersStartSeconds = 60;
constexpr double kStopGraceSeconds = 5;
constexpr double kCancelDeadlineSeconds = 5;
constexpr int kLogTailLines = 20;

using Clock = std::chrono::steady_clock;

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void SleepMs(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

std::string ErrnoText() { return std::strerror(errno); }

// "exited with status 1", "killed by signal 9 (Killed)".
std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    int sig = WTERMSIG(wait_status);
    return absl::StrCat("killed by signal ", sig, " (", strsignal(sig), ")");
  }
  return "stopped";
}

// The directory holding pipemare-coordinator and pipemare-worker:
// $PIPEMARE_BIN_DIR, else the directory of the running pipemarectl.
absl::StatusOr<std::string> BinaryDir() {
  const char* env = std::getenv("PIPEMARE_BIN_DIR");
  if (env != nullptr && *env != '\0') return std::string(env);
  char buffer[4096];
  ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) {
    return absl::InternalError(absl::StrCat(
        "cannot locate pipemarectl (/proc/self/exe): ", ErrnoText(), "; set PIPEMARE_BIN_DIR"));
  }
  buffer[n] = '\0';
  return std::filesystem::path(buffer).parent_path().string();
}

absl::StatusOr<std::string> FindBinary(const std::string& dir, const std::string& name) {
  std::string path = absl::StrCat(dir, "/", name);
  if (access(path.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot run ", path, ": ", ErrnoText(),
                     " (set PIPEMARE_BIN_DIR to the directory with the Pipemare binaries)"));
  }
  return path;
}

absl::StatusOr<std::string> MakeTempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/pipemare-local-XXXXXX");
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  if (mkdtemp(buffer.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot create a directory like ", pattern, ": ", ErrnoText()));
  }
  return std::string(buffer.data());
}

// The file's content without surrounding whitespace ("" if unreadable).
std::string ReadTrimmed(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream text;
  text << in.rdbuf();
  std::string s = text.str();
  const char* blanks = " \t\r\n";
  size_t begin = s.find_first_not_of(blanks);
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(blanks) - begin + 1);
}

// The last `count` lines of a file.
std::vector<std::string> TailLines(const std::string& path, int count) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    lines.push_back(line);
    if (static_cast<int>(lines.size()) > count) lines.pop_front();
  }
  return {lines.begin(), lines.end()};
}

// One process started by the launcher.
struct Child {
  std::string name;  // "coordinator", "worker-1", ...
  std::string log_path;
  pid_t pid = -1;
  bool running = false;
  int wait_status = 0;
};

// The processes of one local run, their logs in one directory. Everything
// started is stopped by StopAll() or, at the latest, the destructor.
class LocalCluster {
 public:
  explicit LocalCluster(std::string dir) : dir_(std::move(dir)) {}
  ~LocalCluster() { StopAll(); }

  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  const std::string& dir() const { return dir_; }

  // Starts `binary args...` with stdout+stderr to DIR/<name>.log.
  absl::Status Start(const std::string& name, const std::string& binary,
                     const std::vector<std::string>& args);

  // Reaps children that have exited. Returns a line for each one that did
  // so unexpectedly (not during StopAll): "worker-2 (pid 7) exited ...".
  std::vector<std::string> ReapExited();

  // True if child `name` is still running (after reaping).
  bool IsRunning(const std::string& name);
  // How child `name` exited.
  std::string ExitOf(const std::string& name);

  // SIGTERM to every running child, up to kStopGraceSeconds for them to
  // exit, then SIGKILL; reaps all.
  void StopAll();

  // The last lines of each child's log (or only `name`'s), on stderr.
  void PrintLogTails(const std::string& name = "");

  // Renames each registered worker's log after the id the coordinator gave
  // it (DIR/w-3.log holds w-3), as `workers` and the coordinator's log name
  // them.
  void NameWorkerLogsByWorkerId();

 private:
  Child* Find(const std::string& name);

  const std::string dir_;
  std::mutex mu_;
  std::vector<Child> children_;
  bool stopping_ = false;
};

absl::Status LocalCluster::Start(const std::string& name, const std::string& binary,
                                 const std::vector<std::string>& args) {
  Child child;
  child.name = name;
  child.log_path = absl::StrCat(dir_, "/", name, ".log");

  // Everything the child needs is prepared before fork(): after it, only
  // async-signal-safe calls (we may have gRPC threads).
  std::vector<std::string> argv_text;
  argv_text.push_back(binary);
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& arg : argv_text) argv.push_back(arg.data());
  argv.push_back(nullptr);
  // The children get their settings from these flags alone: a PIPEMARE_*
  // variable of the user's shell (PIPEMARE_INSECURE, PIPEMARE_METRICS_LISTEN,
  // ...) would otherwise add to or contradict them.
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "PIPEMARE_", 9) != 0) envp.push_back(*e);
  }
  envp.push_back(nullptr);

  int log_fd = open(child.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", child.log_path, ": ", ErrnoText()));
  }
  int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) {
    close(log_fd);
    return absl::InternalError(absl::StrCat("cannot open /dev/null: ", ErrnoText()));
  }

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // Own process group: a terminal's Ctrl-C reaches only pipemarectl, which
    // then cancels the job and stops the children in order.
    setpgid(0, 0);
    // Die with pipemarectl, even if it is SIGKILLed.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // it died before prctl
    dup2(null_fd, STDIN_FILENO);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execve(argv[0], argv.data(), envp.data());
    static const char kMessage[] = "pipemarectl: execve failed\n";
    ssize_t ignored = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
    (void)ignored;
    _exit(127);
  }
  const int fork_errno = errno;
  close(log_fd);
  close(null_fd);
  if (pid < 0) {
    return absl::InternalError(
        absl::StrCat("cannot start ", name, ": fork: ", std::strerror(fork_errno)));
  }
  child.pid = pid;
  child.running = true;
  std::lock_guard<std::mutex> lock(mu_);
  children_.push_back(std::move(child));
  return absl::OkStatus();
}

std::vector<std::string> LocalCluster::ReapExited() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> notes;
  for (Child& child : children_) {
    if (!child.running) continue;
    int status = 0;
    pid_t done = waitpid(child.pid, &status, WNOHANG);
    if (done == child.pid || (done < 0 && errno == ECHILD)) {
      child.running = false;
      child.wait_status = status;
      if (!stopping_) {
        notes.push_back(absl::StrCat(child.name, " (pid ", child.pid, ") ", DescribeExit(status),
                                     "; log: ", child.log_path));
      }
    }
  }
  return notes;
}

Child* LocalCluster::Find(const std::string& name) {
  for (Child& child : children_) {
    if (child.name == name) return &child;
  }
  return nullptr;
}

bool LocalCluster::IsRunning(const std::string& name) {
  ReapExited();
  std::lock_guard<std::mutex> lock(mu_);
  Child* child = Find(name);
  return child != nullptr && child->running;
}

std::string LocalCluster::ExitOf(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  Child* child = Find(name);
  if (child == nullptr) return "was never started";
  if (child->running) return "is running";
  return DescribeExit(child->wait_status);
}

void LocalCluster::StopAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (const Child& child : children_) {
      if (child.running) kill(child.pid, SIGTERM);
    }
  }
  const auto deadline = After(kStopGraceSeconds);
  while (Clock::now() < deadline) {
    ReapExited();
    std::lock_guard<std::mutex> lock(mu_);
    bool any = false;
    for (const Child& child : children_) any = any || child.running;
    if (!any) return;
    SleepMs(50);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (Child& child : children_) {
    if (!child.running) continue;
    std::fprintf(stderr, "%s (pid %d) did not stop within %.0f s; killing it\n", child.name.c_str(),
                 static_cast<int>(child.pid), kStopGraceSeconds);
    kill(child.pid, SIGKILL);
    int status = 0;
    while (waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
    }
    child.running = false;
    child.wait_status = status;
  }
}

void LocalCluster::PrintLogTails(const std::string& name) {
  std::vector<Child> children;
  {
    std::lock_guard<std::mutex> lock(mu_);
    children = children_;
  }
  for (const Child& child : children) {
    if (!name.empty() && child.name != name) continue;
    std::vector<std::string> lines = TailLines(child.log_path, kLogTailLines);
    std::fprintf(stderr, "\n==> %s (last %d lines) <==\n", child.log_path.c_str(), kLogTailLines);
    if (lines.empty()) std::fprintf(stderr, "(empty)\n");
    for (const auto& line : lines) std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

void LocalCluster::NameWorkerLogsByWorkerId() {
  std::lock_guard<std::mutex> lock(mu_);
  // The worker logs "registered with coordinator ADDRESS as ID[, ...]".
  static constexpr char kRegistered[] = "registered with coordinator ";
  for (Child& child : children_) {
    if (child.name.rfind("worker-process-", 0) != 0) continue;
    std::ifstream in(child.log_path);
    std::string line, id;
    while (id.empty() && std::getline(in, line)) {
      size_t at = line.find(kRegistered);
      if (at == std::string::npos) continue;
      at = line.find(" as ", at);
      if (at == std::string::npos) continue;
      at += 4;
      size_t end = at;
      while (end < line.size() && (std::isalnum(static_cast<unsigned char>(line[end])) ||
                                   line[end] == '-' || line[end] == '_')) {
        ++end;
      }
      id = line.substr(at, end - at);
    }
    if (id.empty()) continue;
    const std::string path = absl::StrCat(dir_, "/", id, ".log");
    if (std::rename(child.log_path.c_str(), path.c_str()) == 0) {
      child.name = id;
      child.log_path = path;
    }
  }
}

// Starts the coordinator and waits for its address file. Returns its
// address, or an error (CANCELLED when interrupted).
absl::StatusOr<std::string> StartCoordinator(LocalCluster& cluster, const std::string& binary,
                                             std::vector<std::string> security) {
  const std::string address_file = cluster.dir() + "/coordinator.addr";
  std::vector<std::string> args = {"--listen",
                                   "127.0.0.1:0",
                                   "--address-file",
                                   address_file,
                                   "--metrics-listen",
                                   "127.0.0.1:0",
                                   "--metrics-address-file",
                                   cluster.dir() + "/coordinator.metrics",
                                   "--state-dir",
                                   cluster.dir() + "/state"};
  args.insert(args.end(), security.begin(), security.end());
  absl::Status started = cluster.Start("coordinator", binary, args);
  if (!started.ok()) return started;

  const auto deadline = After(kCoordinatorStartSeconds);
  while (true) {
    if (Interrupted()) return absl::CancelledError("interrupted");
    // Written atomically (rename), so non-empty means complete.
    std::string address = ReadTrimmed(address_file);
    if (!address.empty()) return address;
    if (!cluster.IsRunning("coordinator")) {
      return absl::UnavailableError(absl::StrCat("the coordinator ", cluster.ExitOf("coordinator"),
                                                 " before writing its address"));
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the coordinator did not write ", address_file, " within ",
                       static_cast<int>(kCoordinatorStartSeconds), " s"));
    }
    SleepMs(50);
  }
}

// Starts `count` workers and waits until the coordinator lists that many
// IDLE workers; then prints every service's /metrics address and, if
// `targets_file` is set, writes them there as Prometheus file_sd targets.
absl::Status StartWorkers(LocalCluster& cluster, const std::string& binary,
                          const std::string& coordinator, int count, int threads,
                          const std::string& device, const std::string& targets_file,
                          const std::vector<std::string>& security) {
  for (int k = 1; k <= count; ++k) {
    std::vector<std::string> args = {"--coordinator",      coordinator,
                                     "--listen",           "127.0.0.1:0",
                                     "--threads",          std::to_string(threads),
                                     "--workers-per-host", std::to_string(count),
                                     "--metrics-listen",   "127.0.0.1:0",
                                     "--device",           device};
    args.insert(args.end(), security.begin(), security.end());
    absl::Status started = cluster.Start(absl::StrCat("worker-process-", k), binary, args);
    if (!started.ok()) return started;
  }

  auto stub = ConnectCoordinator(coordinator);
  const auto deadline = After(kWorkersStartSeconds);
  std::string last_problem = "no answer yet";
  while (true) {
    if (Interrupted()) return absl::CancelledError("interrupted");
    for (const std::string& note : cluster.ReapExited()) {
      return absl::UnavailableError(absl::StrCat("a process exited during start-up: ", note));
    }
    auto context = ContextWithDeadline(2);
    v1::ListWorkersResponse response;
    grpc::Status status = stub->ListWorkers(context.get(), v1::ListWorkersRequest(), &response);
    if (status.ok()) {
      int idle = 0;
      for (const auto& worker : response.workers()) {
        if (worker.state() == v1::IDLE) ++idle;
      }
      if (idle >= count) {
        cluster.NameWorkerLogsByWorkerId();
        const std::string coordinator_metrics = ReadTrimmed(cluster.dir() + "/coordinator.metrics");
        std::vector<std::string> worker_metrics;
        for (const auto& worker : response.workers()) {
          if (!worker.metrics_address().empty()) worker_metrics.push_back(worker.metrics_address());
        }
        std::fprintf(stderr, "metrics (Prometheus targets): %s %s\n", coordinator_metrics.c_str(),
                     absl::StrJoin(worker_metrics, " ").c_str());
        if (targets_file.empty()) return absl::OkStatus();
        return WriteFileSdTargets(targets_file, coordinator_metrics, worker_metrics);
      }
      last_problem = absl::StrCat(idle, " of ", count, " workers IDLE");
    } else {
      last_problem = std::string(FromGrpc(status).message());
    }
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("the workers did not register within ",
                                                      static_cast<int>(kWorkersStartSeconds),
                                                      " s (", last_problem, ")"));
    }
    SleepMs(200);
  }
}

// Submits the spec to the local coordinator and follows the job to its end.
// Returns the exit code; prints the final status when the job ended.
int SubmitAndFollow(LocalCluster& cluster, const GlobalOptions& options, const v1::JobSpec& spec,
                    const std::string& export_file) {
  auto stub = ConnectCoordinator(options.coordinator);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  grpc::Status status = stub->SubmitJob(context.get(), request, &response);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  const std::string job_id = response.job().id();
  std::fprintf(stderr, "%s\n", RenderSubmitted(response.job()).c_str());

  FollowOptions follow;
  follow.address = options.coordinator;
  follow.output = options.output;
  follow.print_summary = false;  // the full status follows
  follow.reconnect_seconds = 5;  // this coordinator does not come back
  follow.poll = [&cluster] {
    std::vector<std::string> notes = cluster.ReapExited();
    for (auto& note : notes) note = absl::StrCat("note: ", note);
    return notes;
  };
  FollowResult result = FollowJob(*stub, job_id, follow);

  switch (result.outcome) {
    case FollowOutcome::kInterrupted: {
      std::fprintf(stderr, "interrupted: cancelling %s\n", job_id.c_str());
      auto cancel_context = ContextWithDeadline(kCancelDeadlineSeconds);
      v1::CancelJobRequest cancel;
      cancel.set_id(job_id);
      v1::JobStatus job;
      grpc::Status cancelled = stub->CancelJob(cancel_context.get(), cancel, &job);
      if (!cancelled.ok()) {
        std::fprintf(stderr, "warning: cancel failed: %s\n",
                     std::string(FromGrpc(cancelled).message()).c_str());
      }
      return kExitInterrupted;
    }
    case FollowOutcome::kLostConnection:
      if (!cluster.IsRunning("coordinator")) {
        std::fprintf(stderr, "the coordinator %s\n", cluster.ExitOf("coordinator").c_str());
      }
      return kExitFailed;
    case FollowOutcome::kRpcError:
      return result.exit_code;
    case FollowOutcome::kEnded:
      PrintJobStatus(result.job, options.output);
      if (result.exit_code == kExitOk && !export_file.empty()) {
        return RunExport(options, job_id, 0, export_file);
      }
      return result.exit_code;
  }
  return kExitFailed;
}

}  // namespace

int RunLocal(const GlobalOptions& options, const LocalOptions& local) {
  absl::StatusOr<v1::JobSpec> spec = LoadValidSpec(local.spec_file);
  if (!spec.ok()) return kExitBadInput;
  const int workers = local.workers > 0 ? local.workers : spec->schedule().stages();
  if (workers < spec->schedule().stages()) {
    // Nothing else would ever come to this cluster: the job would wait forever.
    std::fprintf(stderr,
                 "error: --workers %d: the job has %d stages (schedule.stages) and each needs a "
                 "worker; give --workers %d or more, or leave it out\n",
                 workers, spec->schedule().stages(), spec->schedule().stages());
    return kExitBadInput;
  }

  absl::StatusOr<std::string> bin_dir = BinaryDir();
  absl::StatusOr<std::string> coordinator_bin =
      bin_dir.ok() ? FindBinary(*bin_dir, "pipemare-coordinator") : bin_dir.status();
  absl::StatusOr<std::string> worker_bin =
      bin_dir.ok() ? FindBinary(*bin_dir, "pipemare-worker") : bin_dir.status();
  for (const auto* found : {&coordinator_bin, &worker_bin}) {
    if (!found->ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(found->status().message()).c_str());
      return kExitFailed;
    }
  }
  absl::StatusOr<std::string> dir = MakeTempDir();
  if (!dir.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(dir.status().message()).c_str());
    return kExitFailed;
  }

  // TLS between every process and a submit token for this client, from a
  // throwaway CA in the run's directory (gone with it).
  std::vector<std::string> coordinator_security = {"--insecure"}, worker_security = {"--insecure"};
  if (!local.insecure) {
    DevPkiOptions pki_options;
    pki_options.dir = *dir + "/pki";
    pki_options.days = 7;
    absl::StatusOr<DevPki> pki = MakeDevPki(pki_options);
    if (!pki.ok()) {
      std::fprintf(stderr, "error: cannot make the run's certificates: %s\n",
                   std::string(pki.status().message()).c_str());
      return kExitFailed;
    }
    coordinator_security = {
        "--tls-ca",           pki->ca,         "--tls-cert", pki->coordinator_cert, "--tls-key",
        pki->coordinator_key, "--tokens-file", pki->tokens};
    worker_security = {"--tls-ca",           pki->ca,     "--tls-cert",
                       pki->worker_certs[0], "--tls-key", pki->worker_keys[0]};
    SecurityFlags client;
    client.ca_file = pki->ca;
    client.token_file = pki->submit_token;
    absl::StatusOr<RpcSecurity> security = LoadRpcSecurity(client, /*role=*/"");
    if (!security.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(security.status().message()).c_str());
      return kExitFailed;
    }
    SetRpcSecurity(std::move(*security));
  }

  InstallInterruptHandlers();
  int code = kExitFailed;
  {
    LocalCluster cluster(*dir);
    GlobalOptions job_options = options;
    absl::StatusOr<std::string> address =
        StartCoordinator(cluster, *coordinator_bin, coordinator_security);
    absl::Status up = address.status();
    if (up.ok()) {
      job_options.coordinator = *address;
      up = StartWorkers(cluster, *worker_bin, *address, workers, local.threads, local.device,
                        local.prometheus_targets, worker_security);
    }
    if (absl::IsCancelled(up)) {
      code = kExitInterrupted;
      std::fprintf(stderr, "interrupted during start-up\n");
    } else if (!up.ok()) {
      code = kExitFailed;
      std::fprintf(stderr, "error: local cluster did not start: %s\n",
                   std::string(up.message()).c_str());
    } else {
      std::fprintf(stderr, "started coordinator at %s and %d workers, %s (logs in %s)\n",
                   address->c_str(), workers,
                   local.insecure ? "plaintext (--insecure)" : "mutual TLS and a token",
                   dir->c_str());
      code = SubmitAndFollow(cluster, job_options, *spec, local.export_file);
    }
    cluster.StopAll();
    if (code != kExitOk && code != kExitInterrupted) cluster.PrintLogTails();
  }

  if (code == kExitOk && !local.keep_logs) {
    std::error_code ignored;
    std::filesystem::remove_all(*dir, ignored);
  } else {
    std::fprintf(stderr, "logs kept in %s\n", dir->c_str());
  }
  return code;
}

}  // namespace pipemare::client
