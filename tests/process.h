// A tiny harness for multi-process tests: start the real binaries, run the
// real client, read logs. Every child gets PR_SET_PDEATHSIG so a crashed test
// never leaves processes behind.
#ifndef PIPEMARE_TESTS_PROCESS_H_
#define PIPEMARE_TESTS_PROCESS_H_

#include <functional>
#include <string>
#include <vector>

namespace pipemare::testing {

// Directory of the built binaries, the MNIST data and Debian's Fashion-MNIST
// (gzipped idx files; compile definitions).
std::string BinDir();
std::string MnistDir();
std::string FashionMnistDir();

class Process {
 public:
  // Starts `argv` (argv[0] a path) with stdout+stderr to `log_path`.
  Process(std::vector<std::string> argv, std::string log_path);
  ~Process();  // SIGKILLs if still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  int pid() const { return pid_; }
  bool Running();
  void Signal(int sig);
  // Waits up to `seconds` for exit; returns the exit code, or -1 on timeout
  // (128 + signal for a signalled child).
  int Wait(double seconds);
  std::string Log() const;

 private:
  int pid_ = -1;
  int exit_code_ = -1;
  std::string log_path_;
};

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// Runs a command to completion (killed after `timeout_seconds`).
CommandResult Run(const std::vector<std::string>& argv, double timeout_seconds = 120);

// Polls `predicate` every 100 ms for up to `seconds`.
bool WaitFor(double seconds, const std::function<bool()>& predicate);

std::string ReadFile(const std::string& path);

// GET `url` (10 s timeout); returns the body, or "" with `*code` set to the
// HTTP status (0 on a transport error).
std::string HttpGet(const std::string& url, long* code = nullptr);
std::string MakeTempDir();

}  // namespace pipemare::testing

#endif  // PIPEMARE_TESTS_PROCESS_H_
