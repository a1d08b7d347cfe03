#include "common/grpc/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace infinigen {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream s;
  s << in.rdbuf();
  if (s.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " holds no PEM block"));
  }
  return s.str();
}

absl::Status CheckPair(const TlsFiles& f, const std::string& prefix) {
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "cert and ", prefix, "key go together: give both or neither"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& f, const std::string& prefix) {
  if (auto st = CheckPair(f, prefix); !st.ok()) return st;
  if (!f.has_identity()) {
    if (!f.ca.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(prefix, "client_ca (mTLS) needs ", prefix, "cert and ", prefix, "key"));
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions options(
      f.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                   : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto key = ReadPem(f.key, prefix + "key");
  if (!key.ok()) return key.status();
  auto cert = ReadPem(f.cert, prefix + "cert");
  if (!cert.ok()) return cert.status();
  pair.private_key = *key;
  pair.cert_chain = *cert;
  options.pem_key_cert_pairs.push_back(pair);
  if (!f.ca.empty()) {
    auto ca = ReadPem(f.ca, prefix + "client_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& f, const std::string& prefix) {
  if (auto st = CheckPair(f, prefix); !st.ok()) return st;
  if (f.ca.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  auto ca = ReadPem(f.ca, prefix + "ca");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  if (f.has_identity()) {
    auto key = ReadPem(f.key, prefix + "key");
    if (!key.ok()) return key.status();
    auto cert = ReadPem(f.cert, prefix + "cert");
    if (!cert.ok()) return cert.status();
    options.pem_private_key = *key;
    options.pem_cert_chain = *cert;
  }
  return grpc::SslCredentials(options);
}

}  // namespace infinigen
