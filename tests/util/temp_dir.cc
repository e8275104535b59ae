#include "tests/util/temp_dir.h"

#include <unistd.h>

#include <filesystem>
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

}  // namespace tessera::testing
