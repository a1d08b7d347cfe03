#include "gpu_worker/backend/cuda_plugin.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace infinigen {
namespace {

constexpr char kPluginName[] = "libinfinigen_cuda.so";

std::string ExecutableDir() {
  std::string path(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size());
  if (n <= 0) return ".";
  path.resize(static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::vector<std::string> Candidates() {
  if (const char* env = std::getenv("INFINIGEN_CUDA_BACKEND"); env != nullptr && *env != '\0') {
    return {env};
  }
  const std::string dir = ExecutableDir();
  return {absl::StrCat(dir, "/", kPluginName), absl::StrCat(dir, "/../lib/", kPluginName)};
}

struct Plugin {
  void* handle = nullptr;
  std::string failure;  // why handle is null
};

Plugin Open() {
  Plugin p;
  std::vector<std::string> missing;
  for (const std::string& path : Candidates()) {
    if (access(path.c_str(), F_OK) != 0) {
      missing.push_back(path);
      continue;
    }
    p.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (p.handle == nullptr) {
      const char* why = dlerror();
      p.failure = absl::StrCat("cannot load the CUDA backend ", path, ": ",
                               why != nullptr ? why : "dlopen failed",
                               " (CUDA's runtime and cuBLAS libraries must be installed)");
    }
    return p;
  }
  p.failure =
      absl::StrCat("no CUDA backend: ", kPluginName, " is not at ", absl::StrJoin(missing, " or "),
                   " (this build found no nvcc, or the plugin was not installed beside the binary; "
                   "$INFINIGEN_CUDA_BACKEND names it explicitly)");
  return p;
}

// The entry point; the plugin is opened once and stays loaded for the life of the process
// (the backends it made run its code).
absl::StatusOr<CreateCudaBackendFn> EntryPoint() {
  static const Plugin plugin = Open();
  if (plugin.handle == nullptr) return absl::FailedPreconditionError(plugin.failure);
  auto* create =
      reinterpret_cast<CreateCudaBackendFn>(dlsym(plugin.handle, kCreateCudaBackendSymbol));
  if (create == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA backend plugin has no ", kCreateCudaBackendSymbol, " entry point"));
  }
  return create;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> LoadCudaBackend(int device, DType dtype) {
  auto create = EntryPoint();
  if (!create.ok()) return create.status();
  char error[1024] = {0};
  Backend* backend = (*create)(kCudaPluginAbi, sizeof(Backend), device, static_cast<int>(dtype),
                               error, sizeof(error));
  if (backend == nullptr) return absl::FailedPreconditionError(error);
  return std::unique_ptr<Backend>(backend);
}

}  // namespace infinigen
