// The PEM files of a TLS identity, as the services' flags name them. Plain paths, no gRPC, so
// that configs of libraries without gRPC (the KV client's) can carry them.
#pragma once

#include <string>

namespace infinigen {

struct TlsFiles {
  std::string cert;  // this side's certificate chain (PEM)
  std::string key;   // its private key (PEM)
  // Server: clients must present a certificate signed by this CA (mTLS).
  // Client: the CA that signed the server's certificate; setting it turns TLS on.
  std::string ca;

  bool has_identity() const { return !cert.empty(); }
};

}  // namespace infinigen
