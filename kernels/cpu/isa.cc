#include "kernels/cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace infinigen::cpu {
namespace {

Isa Detected() {
  Isa isa = CpuHasAvx512() ? Isa::kAvx512 : Isa::kAvx2;
  const char* cap = std::getenv("INFINIGEN_CPU_ISA");
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0) isa = Isa::kAvx2;
  return isa;
}

std::atomic<int>& Cap() {
  static std::atomic<int> cap{static_cast<int>(Detected())};
  return cap;
}

}  // namespace

bool CpuHasAvx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}

Isa ActiveIsa() { return static_cast<Isa>(Cap().load(std::memory_order_relaxed)); }

void CapIsaForTesting(Isa isa) {
  const Isa most = Detected();
  Cap().store(static_cast<int>(isa == Isa::kAvx512 ? most : Isa::kAvx2));
}

}  // namespace infinigen::cpu
