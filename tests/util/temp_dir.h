// Temporary directories for tests, under GoogleTest's TempDir().
#pragma once

#include <string>

namespace tessera::testing {

// A fresh, empty directory named after the running test (suite, name, pid),
// emptied first if a previous run left it. It stays after the test, for
// inspection.
std::string TestDir();

// A fresh directory "<prefix>.XXXXXX", removed with everything in it when
// the object goes out of scope.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& prefix = "tessera");
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A file's bytes ("" when it cannot be read), and a file written with `bytes` (a GoogleTest
// failure naming it when it cannot be).
std::string ReadBytes(const std::string& path);
void WriteBytes(const std::string& path, const std::string& bytes);

}  // namespace tessera::testing
