// Pins the OpenMP threads that torch's CPU ops compute with. Thread t of the calling thread's team goes to
// cpus[t % len(cpus)] (one_each), or every thread to all of cpus (undoing it). Unpinned, two compute threads on two
// cores are often queued on one core while the other idles, and a migrated thread finds its L2 cold; vLLM's CPU
// worker binds its threads the same way. Built and loaded by pdserve/kernels/__init__.py.
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#include <torch/library.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

namespace {

int64_t pin_threads(at::IntArrayRef cpus, bool one_each) {
  TORCH_CHECK(!cpus.empty(), "pin_threads: no CPUs given");
  for (const int64_t c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "pin_threads: no CPU ", c);
  const std::vector<int64_t> list(cpus.begin(), cpus.end());
  const int n = at::get_num_threads();
  std::atomic<int> err{0};
#pragma omp parallel num_threads(n)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (one_each) {
      CPU_SET(list[omp_get_thread_num() % list.size()], &set);
    } else {
      for (const int64_t c : list) CPU_SET(c, &set);
    }
    if (sched_setaffinity(0, sizeof set, &set) != 0) err = errno;
  }
  TORCH_CHECK(err == 0, "pin_threads: sched_setaffinity failed: ", std::strerror(err));
  return n;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("pin_threads(int[] cpus, bool one_each) -> int", TORCH_FN(pin_threads));  // no tensors: one kernel for all
}
