// Names the calling thread, as `top -H`, perf and gdb show it. Threads
// otherwise inherit their creator's name: a stage's compute thread, started
// from a gRPC handler, showed as gRPC's "grpcpp_sync_ser" and was read as
// one of gRPC's own.
#ifndef PIPEMARE_COMMON_THREAD_NAME_H_
#define PIPEMARE_COMMON_THREAD_NAME_H_

#include <pthread.h>

#include <string>

namespace pipemare {

// At most 15 characters are kept (the kernel's limit).
inline void NameThisThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace pipemare

#endif  // PIPEMARE_COMMON_THREAD_NAME_H_
