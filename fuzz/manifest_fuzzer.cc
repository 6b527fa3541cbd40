// Fuzzes the checkpoint manifest reader (pipeline/core/checkpoint.h): the input
// is written as a step directory's manifest.json and read back.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "pipeline/core/checkpoint.h"

namespace {
std::string StepDir() {
  static const std::string dir = [] {
    std::string d = std::filesystem::temp_directory_path().string() + "/pipemare-manifest-fuzz-" +
                    std::to_string(getpid()) + "/step-7";  // the seeds' step
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = StepDir();
  {
    std::ofstream out(dir + "/manifest.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  (void)pipemare::ReadManifest(dir);
  return 0;
}
