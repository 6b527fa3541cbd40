#include "tests/process.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

namespace pipemare::testing {

std::string BinDir() { return PIPEMARE_BIN_DIR; }
std::string MnistDir() { return PIPEMARE_MNIST_DIR; }
std::string FashionMnistDir() { return PIPEMARE_FASHION_MNIST_DIR; }

namespace {
// The services a test starts take their settings from the test alone: a
// PIPEMARE_* variable of the shell that runs ctest (PIPEMARE_INSECURE,
// PIPEMARE_TOKEN, ...) would add to or contradict the flags. Cleared once
// at start-up; a test may still set one for a process it starts.
const bool kInheritedSettingsCleared = [] {
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (entry.rfind("PIPEMARE_", 0) == 0) names.push_back(entry.substr(0, entry.find('=')));
  }
  for (const std::string& name : names) unsetenv(name.c_str());
  return true;
}();

int Spawn(const std::vector<std::string>& argv, const std::string& out_path,
          const std::string& err_path) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int err = err_path == out_path ? out : open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dup2(out, 1);
  dup2(err, 2);
  int devnull = open("/dev/null", O_RDONLY);
  dup2(devnull, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(args[0], args.data());
  _exit(127);
}

int DecodeStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}
}  // namespace

Process::Process(std::vector<std::string> argv, std::string log_path)
    : log_path_(std::move(log_path)) {
  pid_ = Spawn(argv, log_path_, log_path_);
}

Process::~Process() {
  if (Running()) {
    kill(pid_, SIGKILL);
    Wait(10);
  }
}

bool Process::Running() {
  if (exit_code_ >= 0) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = DecodeStatus(status);
    return false;
  }
  return r == 0;
}

void Process::Signal(int sig) {
  if (Running()) kill(pid_, sig);
}

int Process::Wait(double seconds) {
  WaitFor(seconds, [&] { return !Running(); });
  return exit_code_;
}

std::string Process::Log() const { return ReadFile(log_path_); }

CommandResult Run(const std::vector<std::string>& argv, double timeout_seconds) {
  const std::string dir = MakeTempDir();
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const int pid = Spawn(argv, out, err);
  CommandResult r;
  int status = 0;
  const bool exited =
      WaitFor(timeout_seconds, [&] { return waitpid(pid, &status, WNOHANG) == pid; });
  if (!exited) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    r.exit_code = -1;  // timed out: a hang is a failure
  } else {
    r.exit_code = DecodeStatus(status);
  }
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  unlink(out.c_str());
  unlink(err.c_str());
  rmdir(dir.c_str());
  return r;
}

bool WaitFor(double seconds, const std::function<bool()>& predicate) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (true) {
    if (predicate()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string MakeTempDir() {
  const char* base = getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/pipemare-test-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  char* dir = mkdtemp(buf.data());
  return dir ? dir : "/tmp";
}

namespace {
size_t AppendBody(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}
}  // namespace

std::string HttpGet(const std::string& url, long* code) {
  std::string body;
  CURL* curl = curl_easy_init();
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, AppendBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT, 10L);
  long status = 0;
  if (curl_easy_perform(curl) == CURLE_OK) curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(curl);
  if (code) *code = status;
  return status == 200 ? body : "";
}

}  // namespace pipemare::testing
