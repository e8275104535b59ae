#include "tests/util/temp_dir.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera::testing {

namespace fs = std::filesystem;

std::string TestDir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir =
      fs::path(::testing::TempDir()) /
      absl::StrCat("tessera_", info->test_suite_name(), "_", info->name(), "_", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

ScopedTempDir::ScopedTempDir(const std::string& prefix) {
  std::string pattern = (fs::path(::testing::TempDir()) / (prefix + ".XXXXXX")).string();
  std::vector<char> buffer(pattern.begin(), pattern.end());
  buffer.push_back('\0');
  const char* made = mkdtemp(buffer.data());
  EXPECT_NE(made, nullptr) << "mkdtemp " << pattern;
  path_ = made != nullptr ? made : pattern;
}

ScopedTempDir::~ScopedTempDir() {
  std::error_code ignored;
  fs::remove_all(path_, ignored);
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
  EXPECT_TRUE(out.good()) << "cannot write " << path;
}

}  // namespace tessera::testing
