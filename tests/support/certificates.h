// Throwaway TLS material for tests that run servers with TLS (made with the openssl command).
#pragma once

#include <string>

namespace infinigen::testing {

// A CA (ca.pem) and one certificate signed by it (service.pem, service.key) for `san`, in a
// fresh folder under the test's temporary directory; returns the folder. Fails the test when
// openssl fails.
std::string MakeCertificates(const std::string& name = "tls",
                             const std::string& san = "IP:127.0.0.1,DNS:localhost");

std::string ReadFile(const std::string& path);

}  // namespace infinigen::testing
