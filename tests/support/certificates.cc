#include "tests/support/certificates.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>

namespace infinigen::testing {

std::string MakeCertificates(const std::string& name, const std::string& san) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  const std::string cmd =
      "set -e; mkdir -p " + dir + "; cd " + dir +
      "; openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "-subj /CN=test-ca 2>/dev/null"
      "; openssl req -newkey rsa:2048 -nodes -keyout service.key -out service.csr "
      "-subj /CN=localhost 2>/dev/null"
      "; printf 'subjectAltName=" +
      san +
      "\\n' > ext.cnf"
      "; openssl x509 -req -in service.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out service.pem -days 1 -extfile ext.cnf 2>/dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace infinigen::testing
