// Fuzz target: the token shard reader (trainer/token_shard.h). Inputs are whole shard files; the
// reader maps the file, so each input is written to an in-memory file first.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/contract.h"
#include "tests/fuzz/fuzz_support.h"
#include "trainer/token_shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* file = new tessera::fuzz::MemoryFile();
  absl::StatusOr<tessera::trainer::TokenShard> shard =
      tessera::trainer::TokenShard::Open(file->Write(data, size));
  if (!shard.ok()) return 0;
  // An accepted shard is exactly its header and its tokens; then every token can be read.
  if (tessera::trainer::kTokenShardHeaderBytes + shard->size() * shard->token_bytes() != size) {
    tessera::fuzz::ContractBroken(absl::StrCat("accepted a shard of ", size, " bytes holding ",
                                               shard->size(), " tokens of ", shard->token_bytes(),
                                               " bytes"));
  }
  std::vector<int64_t> tokens(shard->size());
  shard->Read(0, shard->size(), tokens.data());
  for (uint64_t i = 0; i < shard->size(); ++i) {
    if (static_cast<int64_t>(shard->token(i)) != tokens[i]) {
      tessera::fuzz::ContractBroken(absl::StrCat("token ", i, ": token() and Read() disagree"));
    }
  }
  return 0;
}
