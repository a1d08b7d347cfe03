// Which vector instruction set the CPU kernels use, chosen at run time: one binary, built for
// x86-64-v3 (AVX2, FMA), runs on any such CPU and uses AVX-512 where the CPU has it. Kernels
// with an AVX-512 path compute exactly what their AVX2 path computes (the same products in the
// same order), so the choice changes speed, never a result.
#pragma once

// Marks a function that uses AVX-512F instructions: call it only where ActiveIsa() says so.
#define IG_AVX512 __attribute__((target("avx512f")))

namespace infinigen::cpu {

enum class Isa { kAvx2, kAvx512 };

// What the CPU supports, capped by the environment variable INFINIGEN_CPU_ISA ("avx2" or
// "avx512"; read once) and by CapIsaForTesting.
Isa ActiveIsa();
// Whether this CPU (and its operating system) runs AVX-512F code.
bool CpuHasAvx512();
// Tests: run every kernel at most at `isa` (each ISA path forced in turn).
void CapIsaForTesting(Isa isa);

}  // namespace infinigen::cpu
