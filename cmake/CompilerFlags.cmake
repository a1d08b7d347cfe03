# Warnings and code generation for the project's own targets (use infinigen_set_flags(target)).

if(INFINIGEN_NATIVE)
  set(INFINIGEN_CPU_ARCH_FLAGS -march=native)
elseif(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  # AVX2 + FMA + F16C: every x86-64 server of the last decade; the kernels use them.
  set(INFINIGEN_CPU_ARCH_FLAGS -march=x86-64-v3)
else()
  set(INFINIGEN_CPU_ARCH_FLAGS "")
endif()

if(INFINIGEN_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=address,undefined)
endif()

if(INFINIGEN_SANITIZE_THREAD)
  if(INFINIGEN_SANITIZE)
    message(FATAL_ERROR "INFINIGEN_SANITIZE and INFINIGEN_SANITIZE_THREAD exclude each other")
  endif()
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-fsanitize=thread>
                      $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=thread)
endif()

function(infinigen_set_flags target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-sign-compare
                              ${INFINIGEN_CPU_ARCH_FLAGS}>)
endfunction()
