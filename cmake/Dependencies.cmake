# Finds the project's dependencies. Required: Abseil, OpenBLAS, OpenMP, nlohmann_json.
# Optional (each turns a part of the build on): CUDA, UCX, gRPC + Protobuf, GoogleTest,
# Google Benchmark. Everything comes from Debian packages (scripts/setup.sh installs them).

find_package(absl CONFIG REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)

# OpenBLAS built with OpenMP, so that BLAS and our OpenMP kernels share one thread pool (the
# pthread build's threads and OpenMP's spinning workers fight over the cores: 5x slower prefill
# on 2 cores). Debian installs it beside the default pthread build; RPATH makes it win at run time.
find_library(INFINIGEN_OPENBLAS_LIB NAMES openblas
             PATHS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
find_path(INFINIGEN_OPENBLAS_INCLUDE cblas.h
          PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
if(INFINIGEN_OPENBLAS_LIB AND INFINIGEN_OPENBLAS_INCLUDE)
  add_library(infinigen_openblas INTERFACE)
  target_link_libraries(infinigen_openblas INTERFACE ${INFINIGEN_OPENBLAS_LIB})
  target_include_directories(infinigen_openblas INTERFACE ${INFINIGEN_OPENBLAS_INCLUDE})
  set(INFINIGEN_OPENBLAS_VARIANT openmp)
else()
  pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
  add_library(infinigen_openblas INTERFACE)
  target_link_libraries(infinigen_openblas INTERFACE PkgConfig::OPENBLAS)
  set(INFINIGEN_OPENBLAS_VARIANT "default (install libopenblas-openmp-dev for speed)")
endif()
find_package(Threads REQUIRED)

set(INFINIGEN_HAVE_CUDA OFF)
if(INFINIGEN_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    # Debian 12's own cmake (3.25.1) FindCUDAToolkit marks CUDA::nvToolsExt deprecated without
    # checking that the target exists, and CUDA 13 no longer ships that library: configure then
    # fails for any project requiring cmake >= 3.25. An empty stand-in (nothing links it) lets
    # the stock module finish; cmake versions that check the target never see it missing.
    if(NOT TARGET CUDA::nvToolsExt)
      add_library(CUDA::nvToolsExt INTERFACE IMPORTED)
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(INFINIGEN_HAVE_CUDA ON)
  endif()
endif()

set(INFINIGEN_HAVE_UCX OFF)
if(INFINIGEN_WITH_UCX)
  pkg_check_modules(UCX IMPORTED_TARGET ucx)
  if(UCX_FOUND)
    set(INFINIGEN_HAVE_UCX ON)
  endif()
endif()

set(INFINIGEN_HAVE_SERVICES OFF)
if(INFINIGEN_WITH_SERVICES)
  find_package(Protobuf CONFIG QUIET)
  if(NOT Protobuf_FOUND)
    find_package(Protobuf QUIET)
  endif()
  find_package(gRPC CONFIG QUIET)
  find_program(INFINIGEN_GRPC_CPP_PLUGIN grpc_cpp_plugin)
  if(Protobuf_FOUND AND gRPC_FOUND AND INFINIGEN_GRPC_CPP_PLUGIN)
    set(INFINIGEN_HAVE_SERVICES ON)
    # Metrics: prometheus-cpp's core (registry, text format); common/metrics serves them.
    find_package(prometheus-cpp CONFIG REQUIRED)
    # The OpenAI-compatible HTTP front door (openai/): Boost.Beast and Asio, header-only.
    find_package(Boost 1.74 REQUIRED)
    # ... and TLS on its port (Asio's ssl over OpenSSL, the library gRPC already uses).
    find_package(OpenSSL REQUIRED)
  endif()
endif()

if(INFINIGEN_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
endif()
find_package(benchmark CONFIG QUIET)
