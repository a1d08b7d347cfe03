#include "gpu_worker/model/backend_flags.h"

namespace infinigen {

void RegisterBackendFlags(FlagSet& flags, BackendSpec& spec) {
  flags.String("device", &spec.device, "where the model runs: cpu or cuda (GPU 0)");
  flags.String("cuda-dtype", &spec.cuda_dtype,
               "storage of activations, weights and K/V on the GPU: bf16, f16 or f32 (exact)");
  flags.Int("threads", &spec.threads, "CPU threads (0 = OMP_NUM_THREADS, else all cores)");
  flags.String("pin-threads", &spec.pin_threads,
               "keep each CPU thread on one core: on, off, or auto (OMP_PROC_BIND if set, else "
               "on when --threads equals the cores this process may use: a cpuset, taskset or "
               "Kubernetes' static CPU manager)");
  flags.String(
      "cpu-weights", &spec.cpu_weights,
      "weight storage on the CPU: f32 (exact), bf16, q8 (faster decode) or q4_1 (a GGUF "
      "file's 3- to 6-bit matrices' values as they are, Q4_0/Q4_1/Q4_K in Q4_1 blocks, "
      "Q5_0/Q5_1/Q5_K in Q5_1 blocks (Q4_0 and Q5_0 without stored minimums), Q6_K/Q3_K in "
      "Q6_K blocks, the others q8: fastest decode)");
  flags.String("cpu-kv", &spec.cpu_kv,
               "K/V storage on the CPU: f32 (exact) or bf16 (half the bytes a long-context decode "
               "step reads)");
  flags.Bool("batch-invariant", &spec.batch_invariant,
             "a sequence's logits do not depend on the sequences batched with it (CPU; false: "
             "OpenBLAS for prefill, faster, batch-dependent rounding)");
}

}  // namespace infinigen
