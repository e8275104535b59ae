// Fuzz target: the token shard reader (trainer/data/token_shard.h). Inputs are whole shard files; the
// reader maps the file, so each input is written to an in-memory file first.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/contract.h"
#include "tests/fuzz/fuzz_support.h"
#include "trainer/data/token_shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static auto* file = new tessera::fuzz::MemoryFile();
  absl::StatusOr<tessera::trainer::TokenShard> shard =
      tessera::trainer::TokenShard::Open(file->Write(data, size));
  if (!shard.ok()) return 0;
  // An accepted shard is exactly its header, its tokens and, in version 2, a byte per token for
  // each per-token section it declares (loss mask, record starts); then every token and every
  // section byte can be read.
  const uint64_t sections = (shard->has_loss_mask() ? 1 : 0) + (shard->has_record_starts() ? 1 : 0);
  if (tessera::trainer::kTokenShardHeaderBytes +
          shard->size() * (shard->token_bytes() + sections) !=
      size) {
    tessera::fuzz::ContractBroken(absl::StrCat("accepted a shard of ", size, " bytes holding ",
                                               shard->size(), " tokens of ", shard->token_bytes(),
                                               " bytes and ", sections, " per-token sections"));
  }
  std::vector<uint8_t> mask(shard->size()), starts(shard->size());
  shard->ReadLossMask(0, shard->size(), mask.data());
  shard->ReadRecordStarts(0, shard->size(), starts.data());
  std::vector<int64_t> tokens(shard->size());
  shard->Read(0, shard->size(), tokens.data());
  for (uint64_t i = 0; i < shard->size(); ++i) {
    if (static_cast<int64_t>(shard->token(i)) != tokens[i]) {
      tessera::fuzz::ContractBroken(absl::StrCat("token ", i, ": token() and Read() disagree"));
    }
  }
  return 0;
}
